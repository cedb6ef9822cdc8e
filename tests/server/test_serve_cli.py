"""``minisgl serve`` settings and fast failures: no model is loaded in this module."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl.server.settings import (
    PreflightError,
    ServeSettings,
    SettingsError,
    build_parser,
    flag_name,
    parse_settings,
    preflight,
)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MINISGL_")}
    return subprocess.run(
        [sys.executable, "-m", "minisgl", *args],
        capture_output=True,
        text=True,
        env={**full_env, **(env or {})},
        timeout=timeout,
    )


def test_help_lists_every_setting_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from minisgl.cli import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("NO-TORCH")
    for flag in ("--model", "--attn", "--cache", "--page-size", "--dtype", "--device", "--max-running-requests",
                 "--chunked-prefill-size", "--max-model-len", "--host", "--port", "--api-key",
                 "--served-model-name", "--tp", "--num-pages", "--mem-fraction", "--cpu-kv-cache-gb",
                 "--load-format", "--model-config", "--hf-config-path", "--kernels", "--seed",
                 "--cuda-graph-max-bs", "--cuda-graph-max-tokens", "--overlap-schedule",
                 "--kv-pool", "--moe-backend", "--shell", "--nnodes", "--node-rank", "--dist-init-addr",
                 "MINISGL_MAX_RUNNING_REQUESTS"):  # fmt: skip
        assert flag in out.stdout, flag


def test_cli_reference_names_every_flag_and_no_other() -> None:
    """docs/serving.md's flag tables (its CLI reference) and ``minisgl serve --help`` name the same flags."""
    out = run_cli("serve", "--help")
    assert out.returncode == 0, out.stderr
    # Negations (--no-overlap-schedule) stand beside their flag in one row; --help is argparse's.
    helped = {f for f in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", out.stdout) if not f.startswith("--no-")}
    helped.discard("--help")
    reference = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
    rows = [line for line in reference.read_text().splitlines() if line.startswith("| `--")]
    # A row names its flag first; aliases and examples (--model-config, --router-args' flags) stand in its text.
    named = {
        f for row in rows for f in re.findall(r"`(--[a-z][a-z-]*)", row.split("|")[1]) if not f.startswith("--no-")
    }
    mentioned = set(re.findall(r"(--[a-z][a-z-]*)", "\n".join(rows)))
    assert helped - mentioned == set(), f"flags missing from docs/serving.md: {sorted(helped - mentioned)}"
    assert named - helped == set(), f"docs/serving.md names flags serve lacks: {sorted(named - helped)}"


def test_chat_help_lists_the_engine_flags_and_its_own_only() -> None:
    from minisgl.config import EngineFields

    out = run_cli("chat", "--help")
    assert out.returncode == 0, out.stderr
    flags = set(re.findall(r"(--[a-z][a-z-]*)", out.stdout))
    server_only = {flag_name(f) for f in ServeSettings.model_fields if f not in EngineFields.model_fields}
    assert {"--host", "--port", "--api-key", "--shell"} <= server_only
    assert not flags & server_only, sorted(flags & server_only)
    assert {flag_name(f) for f in EngineFields.model_fields} | {"--temperature", "--max-tokens", "--system"} <= flags
    serve = set(re.findall(r"(--[a-z][a-z-]*)", run_cli("serve", "--help").stdout))
    assert server_only <= serve


def test_engine_settings_have_one_definition() -> None:
    """Every engine setting is a serve flag and variable of the same name, with the same default and bounds."""
    from minisgl.config import EngineConfig, EngineFields

    settings = ServeSettings(model="m")
    assert set(settings.engine_fields()) == set(EngineFields.model_fields)
    assert set(EngineConfig.model_fields) == set(EngineFields.model_fields) | {"plugins"}
    parser_dests = {a.dest for a in build_parser()._actions}
    assert set(EngineFields.model_fields) <= parser_dests
    with pytest.raises(SettingsError, match=r"--page-size \(env MINISGL_PAGE_SIZE\)"):
        parse_settings(["--model", "m", "--page-size", "0"])
    from minisgl.core import ValidationError

    with pytest.raises(ValidationError, match="page_size"):
        EngineConfig(model="m", page_size=0)
    # Unset batch limits take the device's defaults in one place, for LLM and serve alike.
    assert (
        EngineConfig(model="m").max_running_requests,
        EngineConfig(model="m", device="cuda").chunked_prefill_size,
    ) == (
        64,
        8192,
    )


def test_environment_sets_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_MODEL", "/models/a")
    monkeypatch.setenv("MINISGL_PAGE_SIZE", "32")
    monkeypatch.setenv("MINISGL_API_KEY", "secret")
    monkeypatch.setenv("MINISGL_HF_CONFIG_PATH", "/cfg.json")
    monkeypatch.setenv("MINISGL_OVERLAP_SCHEDULE", "false")
    s = parse_settings(["--page-size", "64", "--attn", "torch,torch"])
    got = (s.model, s.page_size, s.api_key, s.hf_config_path, s.attention_backend)
    assert got == ("/models/a", 64, "secret", "/cfg.json", "torch,torch")
    assert s.overlap_schedule is False
    fields = s.engine_fields()
    assert fields["attention_backend"] == "torch,torch" and fields["hf_config_path"] == "/cfg.json"
    assert parse_settings(["--overlap-schedule"]).overlap_schedule is True


def test_bad_values_name_the_flag_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINISGL_MODEL", raising=False)
    with pytest.raises(SettingsError, match=r"--model \(env MINISGL_MODEL\) is required"):
        parse_settings([])
    monkeypatch.setenv("MINISGL_PORT", "eighty")
    with pytest.raises(SettingsError, match=r"--port \(env MINISGL_PORT\)"):
        parse_settings(["--model", "m"])
    monkeypatch.delenv("MINISGL_PORT")
    with pytest.raises(SettingsError, match=r"--mem-fraction \(env MINISGL_MEM_FRACTION\): Input should be less"):
        parse_settings(["--model", "m", "--mem-fraction", "2"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--dtype", "float8"])


def test_preflight_checks_names_against_installed_plugins(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    ok = ServeSettings(model=str(tmp_path), attention_backend="torch", device="cpu")
    assert "builtin" in preflight(ok)
    unknown = r"--attn: unknown attention backend 'nope'; installed: .*torch \(minisgl\)"
    with pytest.raises(PreflightError, match=unknown):
        preflight(ServeSettings(model=str(tmp_path), attention_backend="torch,nope"))
    with pytest.raises(PreflightError, match=r"--cache: unknown prefix cache 'lru'"):
        preflight(ServeSettings(model=str(tmp_path), prefix_cache="lru"))
    with pytest.raises(PreflightError, match=r"--model: model path '.*missing' does not exist"):
        preflight(ServeSettings(model=str(tmp_path / "missing")))
    with pytest.raises(PreflightError, match=r"--nnodes \(env MINISGL_NNODES\): must divide tp \(3\), got 2"):
        preflight(ServeSettings(model=str(tmp_path), tp=3, nnodes=2))
    # A KV cache dtype the named backend cannot read (the torch reference reads FP8; the cpu backend does not).
    assert "builtin" in preflight(
        ServeSettings(model=str(tmp_path), attention_backend="torch", device="cpu", kv_cache_dtype="fp8")
    )
    cpu = ServeSettings(model=str(tmp_path), attention_backend="cpu", device="cpu", kv_cache_dtype="fp8_e4m3")
    try:
        preflight(cpu.model_copy(update={"kv_cache_dtype": "auto"}))
    except PreflightError:
        pass  # the cpu backend is not installed or cannot run here
    else:
        with pytest.raises(
            PreflightError,
            match=r"--kv-cache-dtype: attention backend 'cpu' cannot read a fp8_e4m3 KV cache; installed backends "
            r"that can: .*torch",
        ):
            preflight(cpu)
    # An impossible device is refused as the settings are read, before preflight.
    with pytest.raises(SettingsError, match=r"--device \(env MINISGL_DEVICE\): Value error, must be cpu, cuda"):
        parse_settings(["--model", str(tmp_path), "--device", "tpu"])


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--attn", "flashinfr"], {}, "--attn: unknown attention backend 'flashinfr'"),
        ([], {"MINISGL_PREFIX_CACHE": "nocache"}, "--cache: unknown prefix cache 'nocache'"),
        (["--page-size", "0"], {}, "--page-size (env MINISGL_PAGE_SIZE): Input should be greater than or equal to 1"),
    ],
)
def test_serve_fails_at_once_with_a_message(tmp_path: Path, args: list[str], env: dict[str, str], message: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    out = run_cli("serve", "--model", str(tmp_path), *args, env=env)
    assert out.returncode == 2
    assert message in out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize("what", ["directory", "file"])
def test_serve_refuses_a_model_it_cannot_read_in_one_line(tmp_path: Path, what: str) -> None:
    """A directory without config.json (or a file that is not .gguf) fails in preflight: one line, the fix."""
    model = tmp_path / "model"
    if what == "directory":
        model.mkdir()
        (model / "weights.safetensors").write_bytes(b"")
    else:
        model.write_text("not a model")
    out = run_cli("serve", "--model", str(model))
    assert out.returncode == 2
    fix = "point --model at a Hugging Face model directory (config.json + *.safetensors), a .gguf file or dist:NAME"
    problem = (
        f"model directory '{model}' has no config.json"
        if what == "directory"
        else (f"model file '{model}' is not a .gguf file")
    )
    assert out.stderr == f"minisgl serve: error: --model: {problem}: {fix}\n"
    assert out.stdout == ""


def test_serve_refuses_a_busy_port(tmp_path: Path) -> None:
    import socket

    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = run_cli("serve", "--model", str(tmp_path), "--port", str(s.getsockname()[1]))
    assert out.returncode == 2
    assert "cannot listen on 127.0.0.1:" in out.stderr


def test_likely_device_reads_the_torch_build_and_the_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device auto`` is resolved for the preflight checks without importing torch."""
    import importlib.util

    from minisgl.server import settings as serve_settings

    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("torch", pkg / "__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "torch" else None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (pkg / "version.py").write_text("cuda: Optional[str] = None\n")
    assert serve_settings.likely_device() == "cpu"
    (pkg / "version.py").write_text("__version__ = '2.11.0'\ncuda: Optional[str] = '13.0'\n")
    from minisgl.plugins import devices

    monkeypatch.setattr(devices, "nvml_capabilities", lambda: None)
    assert serve_settings.likely_device() is None  # a CUDA build and no driver to ask: unsure
    monkeypatch.setattr(devices, "nvml_capabilities", lambda: [])
    assert serve_settings.likely_device() == "cpu"  # the driver knows no GPU
    monkeypatch.setattr(devices, "nvml_capabilities", lambda: [(9, 0)])
    assert serve_settings.likely_device() == "cuda"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert serve_settings.likely_device() == "cpu"


def test_a_backend_that_cannot_run_here_fails_before_any_worker_starts(tmp_path: Path) -> None:
    """``--attn flashinfer`` with the default ``--device auto`` on a CPU-only torch: refused with the reason."""
    from minisgl.server.settings import likely_device

    if likely_device() != "cpu":
        pytest.skip("needs a machine whose torch runs on the CPU")
    pytest.importorskip("minisgl_plugin_flashinfer")
    (tmp_path / "config.json").write_text("{}")
    out = run_cli("serve", "--model", str(tmp_path), "--attn", "flashinfer", timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--attn: " in out.stderr and "does not support device 'cpu'" in out.stderr
    assert "workers:" not in out.stderr  # nothing was started
