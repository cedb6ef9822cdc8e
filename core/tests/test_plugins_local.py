"""Plugins that are not installed (``plugin_paths`` / ``--plugin-paths``), and plugin lists that keep the built-ins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from minisgl.plugins import PluginError, load_plugins
from minisgl.testing.distributions import subprocess_env

PLUGIN = """
from minisgl.plugins import AttentionBackendSpec, hookimpl

@hookimpl
def minisgl_attention_backends():
    return [AttentionBackendSpec(name="{name}", factory="minisgl.attention:TorchAttnBackend")]
"""


def _write(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(PLUGIN.format(name=name))
    return path


def test_a_file_a_folder_and_a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    one = _write(tmp_path / "single", "loud")
    _write(tmp_path / "many", "quiet")
    _write(tmp_path / "many", "calm")
    (tmp_path / "many" / "_helpers.py").write_text("raise RuntimeError('not a plugin')\n")
    _write(tmp_path / "mods", "modplug")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    reg = load_plugins(discover_installed=False, paths=f"{one},{tmp_path / 'many'},modplug")
    assert reg.names("attention") == ["calm", "loud", "modplug", "quiet"]
    info = {p.name: p for p in reg.plugins}
    assert info["loud"].status == "active" and info["loud"].distribution == str(one.resolve())
    # Named explicitly, a local plugin is loaded whatever MINISGL_PLUGINS allows; a worker's list keeps it too.
    reg = load_plugins(only=["builtin"], environ={"MINISGL_PLUGINS": ""}, paths=str(one))
    assert reg.has("attention", "loud")
    with pytest.raises(PluginError, match="plugin file '.*missing.py' does not exist"):
        load_plugins(discover_installed=False, paths=str(tmp_path / "missing.py"))


def test_a_plugin_list_keeps_the_builtins() -> None:
    reg = load_plugins(only=[])  # e.g. LLM(plugins=("thirdparty",)) without the built-ins named
    assert reg.has("kv_pool", "mha") and reg.has("attention", "torch")
    assert [p.name for p in reg.plugins if p.status == "active"][:1] == ["builtin"]


def test_cli_lists_local_plugins_and_refuses_a_missing_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "loud")
    env = subprocess_env()
    run = [sys.executable, "-m", "minisgl", "plugins"]
    out = subprocess.run([*run, "--plugin-paths", str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert any(line.split()[2:5] == ["loud", "active", "attention:"] for line in out.stdout.splitlines())
    env["MINISGL_PLUGIN_PATHS"] = str(tmp_path / "nope.py")
    out = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "plugin file" in out.stderr and "does not exist" in out.stderr


def test_llm_loads_a_local_plugin(tmp_path: Path) -> None:
    from minisgl import LLM
    from minisgl.testing.models import save_tiny_model

    path = _write(tmp_path / "p", "loud")
    save_tiny_model("LlamaForCausalLM", tmp_path / "m")
    pytest.importorskip("minisgl_plugin_llama", reason="the model needs the llama plugin")
    with LLM(str(tmp_path / "m"), plugin_paths=str(path), attention_backend="loud", num_pages=64) as llm:
        assert llm.engine.attn_specs[0].name == "loud"


def test_a_missing_architecture_is_not_mistaken_for_another(tmp_path: Path) -> None:
    from minisgl.plugins import ModelSpec, PluginSource, UnknownComponentError, hookimpl

    class Models:
        @hookimpl
        def minisgl_models(self):  # type: ignore[no-untyped-def]
            return [
                ModelSpec(name=n, factory="minisgl.models:CausalLM") for n in ("Qwen2ForCausalLM", "LlamaForCausalLM")
            ]

    reg = load_plugins(discover_installed=False, extra=[PluginSource("models", Models())])
    with pytest.raises(UnknownComponentError) as err:
        reg.get("model", "Gemma2ForCausalLM")  # shares "2ForCausalLM" with Qwen2, nothing else
    assert "Did you mean" not in str(err.value) and "docs/plugin-contracts.md#model" in str(err.value)
    with pytest.raises(UnknownComponentError, match="Did you mean 'LlamaForCausalLM'"):
        reg.get("model", "LLamaForCausalLM")


def test_listing_says_what_auto_picks_on_a_device() -> None:
    import io
    import json

    from minisgl.plugins.listing import main as listing

    out = io.StringIO()
    assert listing(["--json", "--device", "cpu"], stdout=out) in (0, 1)
    auto = json.loads(out.getvalue())["auto"]
    assert auto["kv_pool"] == "mha" and auto["attention"] in ("cpu", "torch") and "model" not in auto
    assert auto["kernels"] in ("native", "torch")
    assert auto["grammar"] in ("xgrammar", "-")  # "-": no grammar backend installed
    out = io.StringIO()
    listing(["--device", "cpu"], stdout=out)
    assert out.getvalue().rstrip().splitlines()[-1].startswith("auto on cpu: attention ")
