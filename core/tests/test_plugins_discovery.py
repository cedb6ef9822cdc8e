"""Plugins found through real entry points: fake installed distributions on PYTHONPATH of a subprocess.

Each test writes ``NAME-VERSION.dist-info`` folders (METADATA + entry_points.txt)
next to the plugin's modules, exactly as pip would leave them in site-packages,
and runs the real ``minisgl`` command or ``load_plugins()`` in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from minisgl.testing.distributions import subprocess_env, write_distribution

HEAVY = ("torch", "flashinfer", "flash_attn", "triton", "transformers")

GOOD_PLUGIN = """
    from minisgl.plugins import AttentionBackendSpec, PrefixCacheSpec, hookimpl

    @hookimpl
    def minisgl_attention_backends():
        return [AttentionBackendSpec(name="good", factory="good_plugin.kernel:GoodBackend", aliases=("gd",),
                                     priority=-5, is_supported="good_plugin.kernel:is_supported")]

    @hookimpl
    def minisgl_prefix_caches():
        return [PrefixCacheSpec(name="good-cache", factory="good_plugin.kernel:GoodCache", priority=-5)]
"""

GOOD_KERNEL = """
    import torch  # heavy: must only be imported when a component is built

    from minisgl.attention.torch_backend import TorchAttnBackend
    from minisgl.kvcache import NaivePrefixCache

    class GoodBackend(TorchAttnBackend):
        pass

    class GoodCache(NaivePrefixCache):
        pass

    def is_supported(device):
        return True
"""


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One folder per fake distribution, so each test puts on the path just the ones it needs."""
    root = tmp_path_factory.mktemp("dists")
    made = {
        "good": write_distribution(
            root / "good",
            "minisgl-plugin-good",
            "1.2.0",
            entry_points={"good": "good_plugin.plugin"},
            files={
                "good_plugin/__init__.py": "",
                "good_plugin/plugin.py": GOOD_PLUGIN,
                "good_plugin/kernel.py": GOOD_KERNEL,
            },
        ),
        "broken": write_distribution(
            root / "broken",
            "minisgl-plugin-broken",
            "0.3",
            entry_points={"broken": "broken_plugin"},
            files={"broken_plugin/__init__.py": "import not_installed_kernel_lib  # noqa\n"},
        ),
        "ancient": write_distribution(
            root / "ancient",
            "minisgl-plugin-ancient",
            "0.0.1",
            entry_points={"ancient": "ancient_plugin"},
            requires=["minisgl>=99"],
            files={"ancient_plugin/__init__.py": "raise RuntimeError('an incompatible plugin must not be imported')\n"},
        ),
    }
    for key, dist, entry in (("clash_a", "minisgl-plugin-clash-a", "clasha"), ("clash_b", "other-clash-b", "clashb")):
        made[key] = write_distribution(
            root / key,
            dist,
            "2.0",
            entry_points={entry: f"{entry}_plugin"},
            files={
                f"{entry}_plugin.py": """
                from minisgl.plugins import AttentionBackendSpec, hookimpl

                @hookimpl
                def minisgl_attention_backends():
                    return [AttentionBackendSpec(name="dup", factory="collections:OrderedDict")]
            """
            },
        )
    made["same_entry"] = write_distribution(
        root / "same_entry",
        "unrelated-dist",
        "5.0",
        entry_points={"good": "unrelated_plugin"},
        files={"unrelated_plugin.py": ""},
    )
    return made


def run(args: list[str], *paths: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=subprocess_env(*paths, **env), capture_output=True, text=True, timeout=120
    )


def listing(*paths: Path, **env: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    proc = run(["-m", "minisgl", "plugins", "--json"], *paths, **env)
    return json.loads(proc.stdout), proc


def by_name(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in data["plugins"]}


def test_loading_imports_no_heavy_library(dists: dict[str, Path]) -> None:
    """Every installed plugin's entry module (built-ins included) and the CLI stay free of torch & co."""
    code = (
        "import sys\n"
        "from minisgl.plugins import load_plugins\n"
        "from minisgl.cli import main\n"
        "reg = load_plugins()\n"
        "assert reg.has('attention', 'gd') and reg.has('prefix_cache', 'good-cache'), reg.active_plugin_names()\n"
        "main(['--help']); main(['plugins']); main(['plugins', '--json'])\n"
        f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    proc = run(["-c", code], dists["good"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY []"


def test_lazy_factory_builds_the_component(dists: dict[str, Path]) -> None:
    code = (
        "import sys\n"
        "from minisgl.plugins import load_plugins\n"
        "spec = load_plugins().pick('prefix_cache', 'good-cache', 'cpu')\n"
        "cache = spec.build(page_size=4, device='cpu')\n"
        "print(type(cache).__module__, type(cache).__name__, 'torch' in sys.modules)\n"
    )
    proc = run(["-c", code], dists["good"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["good_plugin.kernel", "GoodCache", "True"]


def test_listing_json(dists: dict[str, Path]) -> None:
    data, proc = listing(dists["good"], dists["broken"], dists["ancient"])
    assert proc.returncode == 0, proc.stderr
    plugins = by_name(data)
    assert plugins["builtin"]["status"] == "active" and plugins["builtin"]["distribution"] == "minisgl"
    good = plugins["good"]
    assert (good["distribution"], good["version"], good["status"], good["module"]) == (
        "minisgl-plugin-good",
        "1.2.0",
        "active",
        "good_plugin.plugin",
    )
    assert good["provides"] == {"attention": ["good"], "prefix_cache": ["good-cache"]}
    broken = plugins["broken"]
    assert broken["status"] == "failed"
    assert broken["error"] == "ModuleNotFoundError: No module named 'not_installed_kernel_lib'"
    ancient = plugins["ancient"]
    assert ancient["status"] == "incompatible" and ancient["provides"] == {}
    assert ancient["error"].startswith("requires minisgl>=99, but minisgl 0.3.0 is installed: install a release of ")
    assert ancient["error"].endswith("or disable it with MINISGL_DISABLE_PLUGINS=ancient")
    good_row = next(c for c in data["components"]["attention"] if c["name"] == "good")
    assert good_row == {
        "name": "good",
        "aliases": ["gd"],
        "auto": False,
        "priority": -5,
        "override": False,
        "description": "",
        "factory": "good_plugin.kernel:GoodBackend",
        "plugin": "good",
        "distribution": "minisgl-plugin-good",
        "kv_cache_dtypes": [],
        "decode_kv_cache_dtypes": [],
    }
    assert data["conflicts"] == []
    # The broken plugin's warning names it and its cause, on stderr and in the JSON.
    assert (
        "plugin 'broken' (minisgl-plugin-broken 0.3) failed to import 'broken_plugin': ModuleNotFoundError: "
        "No module named 'not_installed_kernel_lib'" in proc.stderr
    )
    assert any("plugin 'ancient' (minisgl-plugin-ancient 0.0.1) is incompatible" in w for w in data["warnings"])


def test_listing_table(dists: dict[str, Path]) -> None:
    proc = run(["-m", "minisgl", "plugins"], dists["good"], dists["broken"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["DISTRIBUTION", "VERSION", "ENTRY", "STATUS", "PROVIDES"]
    good = lines.index(next(ln for ln in lines if ln.startswith("minisgl-plugin-good ")))
    assert lines[good].split() == [
        "minisgl-plugin-good",
        "1.2.0",
        "good",
        "active",
        "attention:",
        "good",
        "(alias",
        "gd)",
    ]
    assert lines[good + 1].split() == ["prefix_cache:", "good-cache"]
    broken = next(ln for ln in lines if ln.startswith("minisgl-plugin-broken "))
    assert broken.split()[:5] == ["minisgl-plugin-broken", "0.3", "broken", "failed", "ModuleNotFoundError:"]
    builtin = lines.index(next(ln for ln in lines if ln.startswith("minisgl ")))
    assert lines[builtin].split() == [
        "minisgl",
        "0.3.0",
        "builtin",
        "active",
        "attention:",
        "torch",
        "(KV",
        "cache",
        "fp8_e4m3,",
        "fp8_e5m2)",
    ]
    assert lines[builtin + 1].split() == ["kv_pool:", "mha"]


def test_allow_list_from_the_environment(dists: dict[str, Path]) -> None:
    data, proc = listing(dists["good"], dists["broken"], MINISGL_PLUGINS="good")
    plugins = by_name(data)
    assert (plugins["good"]["status"], plugins["broken"]["status"], plugins["builtin"]["status"]) == (
        "active",
        "disabled",
        "active",
    )
    assert "broken" not in proc.stderr  # a disabled plugin is never imported, so it cannot warn
    data, _ = listing(dists["good"], MINISGL_PLUGINS="")
    assert [p["name"] for p in data["plugins"] if p["status"] == "active"] == ["builtin"]


def test_block_list_from_the_environment(dists: dict[str, Path]) -> None:
    data, proc = listing(dists["good"], MINISGL_DISABLE_PLUGINS="good,nosuch")
    assert by_name(data)["good"]["status"] == "disabled"
    assert "MINISGL_DISABLE_PLUGINS names unknown plugin 'nosuch'" in proc.stderr
    assert proc.returncode == 0


def test_name_clash_stops_start_up(dists: dict[str, Path]) -> None:
    proc = run(["-c", "from minisgl.plugins import load_plugins; load_plugins()"], dists["clash_a"], dists["clash_b"])
    assert proc.returncode != 0
    assert "PluginError: conflicting plugins:" in proc.stderr
    assert (
        "attention backend 'dup' is provided by both plugin 'clasha' (minisgl-plugin-clash-a 2.0) and "
        "plugin 'clashb' (other-clash-b 2.0)" in proc.stderr
    )
    data, listed = listing(dists["clash_a"], dists["clash_b"])
    assert listed.returncode == 1 and len(data["conflicts"]) == 1
    assert "error: attention backend 'dup' is provided by both" in listed.stderr
    # Disabling one of them is the documented way out.
    proc = run(
        [
            "-c",
            "from minisgl.plugins import load_plugins; print(load_plugins().provider('attention', 'dup').distribution)",
        ],
        dists["clash_a"],
        dists["clash_b"],
        MINISGL_DISABLE_PLUGINS="clashb",
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "minisgl-plugin-clash-a"


def test_same_entry_name_from_two_distributions(dists: dict[str, Path]) -> None:
    data, proc = listing(dists["good"], dists["same_entry"])
    assert proc.returncode == 1
    assert data["conflicts"] == [
        "two installed distributions register the plugin entry name 'good': plugin 'good' (minisgl-plugin-good 1.2.0) "
        "and plugin 'good' (unrelated-dist 5.0); uninstall one of them"
    ]


def test_strict_mode_from_the_environment(dists: dict[str, Path]) -> None:
    proc = run(
        ["-c", "from minisgl.plugins import load_plugins; load_plugins()"], dists["broken"], MINISGL_STRICT_PLUGINS="1"
    )
    assert proc.returncode != 0
    assert "PluginError: plugin 'broken' (minisgl-plugin-broken 0.3) failed to import 'broken_plugin'" in proc.stderr
    data, listed = listing(dists["broken"], MINISGL_STRICT_PLUGINS="1")
    assert listed.returncode == 1 and by_name(data)["broken"]["status"] == "failed"
    assert "MINISGL_STRICT_PLUGINS is set, so an engine would not start" in listed.stderr


def test_plugins_help() -> None:
    proc = run(["-m", "minisgl", "plugins", "--help"])
    assert proc.returncode == 0
    assert "usage: minisgl plugins [-h] [--json]" in proc.stdout
    assert "MINISGL_PLUGINS" in proc.stdout
