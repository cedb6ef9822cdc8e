"""The plugin loader and registries, driven in-process through ``load_plugins(extra=...)``.

Installed plugins are left out (``discover_installed=False``) so that these tests
see exactly the plugins they define; discovery through real entry points is
tested in test_plugins_discovery.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import tomllib
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

from minisgl.plugins import (
    FIRST_PARTY,
    HOOKS,
    AttentionBackendSpec,
    Kind,
    KVPoolSpec,
    ModelSpec,
    MoEBackendSpec,
    PluginError,
    PluginRegistry,
    PluginSource,
    PluginWarning,
    PrefixCacheSpec,
    UnknownComponentError,
    check_compatible,
    core_version,
    hookimpl,
    load_plugins,
)

BUILTIN = PluginSource("builtin", "minisgl.plugins.builtin", "minisgl", "0.2.0")


def plugin(name: str, **hooks: Any) -> types.ModuleType:
    """A plugin module whose hooks return the given lists (or call the given functions)."""
    module = types.ModuleType(f"fake_plugin_{name}")
    for hook, result in hooks.items():

        def impl(result: Any = result) -> Any:
            return result() if callable(result) else result

        impl.__name__ = hook
        setattr(module, hook, hookimpl(specname=hook)(impl))
    return module


def source(name: str, dist: str = "", **hooks: Any) -> PluginSource:
    return PluginSource(name, plugin(name, **hooks), dist or f"minisgl-plugin-{name}", "1.0")


def load(*sources: PluginSource, env: dict[str, str] | None = None, **kwargs: Any) -> PluginRegistry:
    return load_plugins(extra=[BUILTIN, *sources], environ=env or {}, discover_installed=False, **kwargs)


def attn(name: str, **kw: Any) -> AttentionBackendSpec:
    return AttentionBackendSpec(name=name, factory="minisgl.attention.torch_backend:TorchAttnBackend", **kw)


# ------------------------------------------------------------------ built-ins
def test_builtin_components() -> None:
    reg = load()
    assert reg.names("attention") == ["torch"]
    assert reg.names("kernels") == ["torch"]
    assert reg.names("kv_pool") == ["mha"]
    assert reg.names("prefix_cache") == ["naive"]
    assert reg.names("moe") == ["torch"]
    assert reg.names("model") == []
    assert reg.names("grammar") == []  # structured output comes from a plugin (minisgl-plugin-xgrammar)
    assert reg.active_plugin_names() == ["builtin"]
    assert reg.provider("kv_pool", "mha").distribution == "minisgl"


def test_builtin_factories_resolve_to_the_core_classes() -> None:
    from minisgl.attention.torch_backend import TorchAttnBackend
    from minisgl.kvcache import MHAKVPool, NaivePrefixCache

    reg = load()
    assert reg.get("attention", "torch").load_factory() is TorchAttnBackend
    assert reg.get("kv_pool", "mha").load_factory() is MHAKVPool
    cache = reg.get("prefix_cache", "naive").build(page_size=4, device="cpu")
    assert isinstance(cache, NaivePrefixCache) and cache.page_size == 4


# ---------------------------------------------------------------------- specs
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": "a,b"}, ValueError, "no commas or spaces"),
        ({"name": ""}, ValueError, "invalid"),
        ({"name": "auto"}, ValueError, "reserved"),
        ({"name": "x", "aliases": ["y"]}, TypeError, "aliases must be a tuple"),
        ({"name": "x", "aliases": ("x",)}, ValueError, "its own name"),
        ({"name": "x", "factory": "pkg.module"}, ValueError, "'package.module:attribute'"),
        ({"name": "x", "factory": 42}, TypeError, "must be a callable"),
        ({"name": "x", "is_supported": "nope"}, ValueError, "is_supported must be"),
        ({"name": "x", "priority": "high"}, TypeError, "priority must be an int"),
    ],
)
def test_spec_validation(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    kwargs.setdefault("factory", "pkg.mod:Cls")
    with pytest.raises(error, match=match):
        AttentionBackendSpec(**kwargs)


def test_specs_are_frozen_and_typed() -> None:
    spec = KVPoolSpec(name="p", factory="pkg.mod:Pool")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "q"  # type: ignore[misc]
    assert (spec.kind, ModelSpec(name="M", factory=dict).kind, MoEBackendSpec(name="m", factory=dict).kind) == (
        "kv_pool",
        "model",
        "moe",
    )
    assert PrefixCacheSpec(name="c", factory=dict).label == "prefix cache 'c'"


def test_lazy_factory_is_imported_only_on_build() -> None:
    spec = AttentionBackendSpec(name="lazy", factory="no_such_module_for_minisgl.kernels:Backend")
    reg = load(source("lazy", minisgl_attention_backends=[spec]))
    assert reg.get("attention", "lazy") is spec  # registering did not import anything
    with pytest.raises(
        PluginError,
        match=r"cannot load the factory 'no_such_module_for_minisgl.kernels:Backend' "
        r"of attention backend 'lazy': ModuleNotFoundError",
    ):
        spec.build(None)
    assert AttentionBackendSpec(name="od", factory="collections:OrderedDict").build(a=1) == {"a": 1}


def test_factory_errors_are_not_rewrapped() -> None:
    def factory(ctx: object) -> None:
        raise ValueError("head_dim 96 is not supported")

    with pytest.raises(ValueError, match="head_dim 96"):
        attn("x").__class__(name="x", factory=factory).build(None)


# ---------------------------------------------------- aliases, priority, auto
def test_aliases_resolve_to_the_same_spec() -> None:
    spec = attn("flash", aliases=("fl", "fast"))
    reg = load(source("flash", minisgl_attention_backends=[spec]))
    assert reg.get("attention", "fl") is spec and reg.get("attention", "fast") is spec
    assert reg.has("attention", "fast") and not reg.has("kv_pool", "fast")
    assert reg.names("attention") == ["flash", "torch"]


def test_auto_picks_the_highest_priority_supported_spec() -> None:
    gpu_only = attn("gpu", auto=True, priority=10, is_supported=lambda device: device == "cuda")
    mid = attn("mid", auto=True, priority=5, is_supported="operator:truth")  # a lazy check, true for any device name
    reg = load(source("k", minisgl_attention_backends=[gpu_only, mid]))
    assert reg.pick("attention", "auto", "cuda").name == "gpu"
    assert reg.pick("attention", "auto", "cuda:1").name == "gpu"  # the device index does not matter
    assert reg.pick("attention", "auto", "cpu").name == "mid"
    assert reg.supported("attention", "cpu") == ["mid", "torch"]
    with pytest.raises(
        UnknownComponentError,
        match=r"^attention backend 'gpu' does not support device 'cpu'; "
        r"attention backends that do: mid, torch$",
    ):
        reg.pick("attention", "gpu", "cpu")


def test_broken_support_check_means_unsupported() -> None:
    def check(device: str) -> bool:
        raise RuntimeError("driver missing")

    reg = load(source("k", minisgl_attention_backends=[attn("odd", auto=True, priority=99, is_supported=check)]))
    assert reg.pick("attention", "auto", "cpu").name == "torch"


def test_auto_with_nothing_supported() -> None:
    reg = load(source("k", minisgl_moe_backends=[]), env={"MINISGL_DISABLE_PLUGINS": "builtin"})
    with pytest.raises(UnknownComponentError, match="no installed MoE backend supports device 'cpu'; installed: none"):
        reg.pick("moe", "auto", "cpu")


# -------------------------------------------------------------- clashes
def test_name_clash_names_both_distributions() -> None:
    a = source("fa", "minisgl-plugin-fa", minisgl_attention_backends=[attn("fa")])
    b = source("fa2", "other-fa-kernels", minisgl_attention_backends=[attn("fa")])
    with pytest.raises(PluginError) as info:
        load(a, b)
    msg = str(info.value)
    assert (
        "attention backend 'fa' is provided by both plugin 'fa' (minisgl-plugin-fa 1.0) and "
        "plugin 'fa2' (other-fa-kernels 1.0)" in msg
    )
    assert "MINISGL_DISABLE_PLUGINS=fa2" in msg and "override=True" in msg


def test_clash_with_an_alias_is_a_clash() -> None:
    a = source("a", minisgl_attention_backends=[attn("alpha", aliases=("fast",))])
    b = source("b", minisgl_attention_backends=[attn("fast")])
    with pytest.raises(PluginError, match="attention backend 'fast' is provided by both plugin 'a'"):
        load(a, b)


def test_clash_tolerated_for_listing() -> None:
    a = source("a", minisgl_kv_cache_pools=[KVPoolSpec(name="mha", factory=dict)])
    reg = load(a, raise_conflicts=False)
    assert reg.provider("kv_pool", "mha").name == "builtin"  # the first one loaded stays
    assert len(reg.conflicts) == 1 and "KV cache pool 'mha' is provided by both plugin 'builtin'" in reg.conflicts[0]


def test_duplicate_within_one_plugin() -> None:
    a = source("a", minisgl_attention_backends=[attn("x"), attn("y", aliases=("x",))])
    with pytest.raises(PluginError, match="plugin 'a' .* declares attention backend 'x' twice"):
        load(a)


def test_same_name_in_different_kinds_is_fine() -> None:
    reg = load(
        source("m", minisgl_moe_backends=[MoEBackendSpec(name="torch2", factory=dict)]),
        source("n", minisgl_kv_cache_pools=[KVPoolSpec(name="torch", factory=dict)]),
    )
    assert reg.get("kv_pool", "torch").factory is dict and reg.get("attention", "torch").factory is not dict


@pytest.mark.parametrize("order", ["override-last", "override-first"])
def test_override_wins_with_a_warning(order: str) -> None:
    mine = attn("torch", override=True, description="patched")
    over = source("patch", "my-patch", minisgl_attention_backends=[mine])
    plain = source("zzz", "zzz-dist", minisgl_attention_backends=[attn("torch")])
    # Built-ins load first, so "override-last" replaces the built-in; "override-first" then sees a plain clash.
    sources = (over,) if order == "override-last" else (over, plain)
    with pytest.warns(PluginWarning) as record:
        reg = load(*sources)
    messages = [str(w.message) for w in record]
    assert (
        "attention backend 'torch' from plugin 'patch' (my-patch 1.0) overrides the one from plugin 'builtin' "
        "(minisgl 0.2.0)" in messages
    )
    if order == "override-first":
        assert (
            "attention backend 'torch' from plugin 'patch' (my-patch 1.0) overrides the one from plugin 'zzz' "
            "(zzz-dist 1.0)" in messages
        )
    assert reg.get("attention", "torch") is mine
    builtin = next(p for p in reg.plugins if p.name == "builtin")
    assert "attention" not in builtin.provides and builtin.overridden == {"attention": ["torch"]}
    if order == "override-first":
        zzz = next(p for p in reg.plugins if p.name == "zzz")
        assert zzz.overridden == {"attention": ["torch"]} and zzz.provides == {}


def test_two_overrides_are_a_clash() -> None:
    a = source("a", minisgl_attention_backends=[attn("k", override=True)])
    b = source("b", minisgl_attention_backends=[attn("k", override=True)])
    with pytest.raises(PluginError, match=r"both set override=True"):
        load(a, b)


# ------------------------------------------------------- broken plugins
def test_plugin_that_fails_to_import_is_skipped_with_a_warning() -> None:
    broken = PluginSource("broken", "no_such_module_for_minisgl.plugin", "minisgl-plugin-broken", "0.3")
    with pytest.warns(
        PluginWarning,
        match=r"plugin 'broken' \(minisgl-plugin-broken 0.3\) failed to import "
        r"'no_such_module_for_minisgl.plugin': ModuleNotFoundError: No module "
        r"named 'no_such_module_for_minisgl'; the plugin is skipped",
    ):
        reg = load(broken)
    info = next(p for p in reg.plugins if p.name == "broken")
    assert info.status == "failed" and info.error.startswith("ModuleNotFoundError")
    assert reg.active_plugin_names() == ["builtin"]


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_strict_makes_a_broken_plugin_fatal(how: str) -> None:
    broken = PluginSource("broken", "no_such_module_for_minisgl.plugin", "minisgl-plugin-broken", "0.3")
    kwargs: dict[str, Any] = {"strict": True} if how == "argument" else {"env": {"MINISGL_STRICT_PLUGINS": "1"}}
    with pytest.raises(PluginError, match=r"plugin 'broken' .* failed to import .*MINISGL_STRICT_PLUGINS is set"):
        load(broken, **kwargs)


def test_failing_hook_drops_the_whole_plugin() -> None:
    def boom() -> list[Any]:
        raise RuntimeError("cannot probe the GPU")

    bad = source("bad", minisgl_kv_cache_pools=[KVPoolSpec(name="good-pool", factory=dict)], minisgl_moe_backends=boom)
    with pytest.warns(PluginWarning, match="a hook failed: RuntimeError: cannot probe the GPU"):
        reg = load(bad)
    assert not reg.has("kv_pool", "good-pool")
    assert next(p for p in reg.plugins if p.name == "bad").status == "failed"


@pytest.mark.parametrize(
    ("result", "match"),
    [
        (attn("single"), "must return an iterable of AttentionBackendSpec, got AttentionBackendSpec"),
        ([KVPoolSpec(name="p", factory=dict)], "returned a KVPoolSpec, expected AttentionBackendSpec"),
        (42, "must return an iterable"),
    ],
)
def test_hook_returning_the_wrong_thing(result: Any, match: str) -> None:
    with pytest.warns(PluginWarning, match=match):
        reg = load(source("bad", minisgl_attention_backends=result))
    assert next(p for p in reg.plugins if p.name == "bad").status == "failed"


def test_misspelled_hook_is_reported() -> None:
    with pytest.warns(
        PluginWarning,
        match=r"'minisgl_attention_backend' is not a minisgl hook .* did you mean "
        r"'minisgl_attention_backends'",
    ):
        reg = load(source("typo", minisgl_attention_backend=[attn("t")]))
    assert next(p for p in reg.plugins if p.name == "typo").status == "failed"


def test_plugin_can_be_an_object_with_hook_methods() -> None:
    class Provider:
        @hookimpl
        def minisgl_prefix_caches(self) -> list[PrefixCacheSpec]:
            return [PrefixCacheSpec(name="obj-cache", factory="minisgl.kvcache.naive:NaivePrefixCache")]

    reg = load(PluginSource("obj", Provider(), "obj-dist", "2.0"))
    assert reg.provider("prefix_cache", "obj-cache").distribution == "obj-dist"


# ---------------------------------------------------- allow and block lists
def _three() -> tuple[PluginSource, ...]:
    return tuple(source(n, minisgl_kv_cache_pools=[KVPoolSpec(name=f"pool-{n}", factory=dict)]) for n in "abc")


def _status(reg: PluginRegistry) -> dict[str, str]:
    return {p.name: p.status for p in reg.plugins}


def test_empty_allow_list_means_no_third_party_plugins() -> None:
    reg = load(*_three(), env={"MINISGL_PLUGINS": ""})
    assert _status(reg) == {"builtin": "active", "a": "disabled", "b": "disabled", "c": "disabled"}
    assert reg.names("kv_pool") == ["mha"]


def test_allow_list() -> None:
    reg = load(*_three(), env={"MINISGL_PLUGINS": " a , c"})
    assert _status(reg) == {"builtin": "active", "a": "active", "b": "disabled", "c": "active"}
    assert reg.names("kv_pool") == ["mha", "pool-a", "pool-c"]


def test_block_list() -> None:
    reg = load(*_three(), env={"MINISGL_DISABLE_PLUGINS": "b"})
    assert _status(reg) == {"builtin": "active", "a": "active", "b": "disabled", "c": "active"}


def test_block_list_beats_allow_list() -> None:
    reg = load(*_three(), env={"MINISGL_PLUGINS": "a,b", "MINISGL_DISABLE_PLUGINS": "b"})
    assert reg.active_plugin_names() == ["builtin", "a"]


def test_unknown_names_in_the_lists_warn() -> None:
    with pytest.warns(PluginWarning) as record:
        load(*_three(), env={"MINISGL_PLUGINS": "a,bb", "MINISGL_DISABLE_PLUGINS": "zzz"})
    messages = [str(w.message) for w in record]
    assert (
        "MINISGL_PLUGINS names unknown plugin 'bb' (did you mean 'b'?); installed plugins: a, b, builtin, c" in messages
    )
    assert "MINISGL_DISABLE_PLUGINS names unknown plugin 'zzz'; installed plugins: a, b, builtin, c" in messages


def test_only_loads_exactly_the_parents_list() -> None:
    parent = load(*_three(), env={"MINISGL_DISABLE_PLUGINS": "b"})
    # A worker gets the parent's list; its own environment no longer matters.
    child = load(*_three(), env={"MINISGL_PLUGINS": ""}, only=parent.active_plugin_names())
    assert child.active_plugin_names() == parent.active_plugin_names() == ["builtin", "a", "c"]
    assert child.names("kv_pool") == parent.names("kv_pool")
    with pytest.warns(PluginWarning, match="the plugin list names unknown plugin 'gone'"):
        load(only=["builtin", "gone"])


def test_registries_are_independent() -> None:
    with_a = load(_three()[0])
    without = load()
    assert with_a.has("kv_pool", "pool-a") and not without.has("kv_pool", "pool-a")


# ---------------------------------------------------------- compatibility
def test_incompatible_core_version() -> None:
    old = PluginSource(
        "old",
        plugin("old", minisgl_kv_cache_pools=[KVPoolSpec(name="old-pool", factory=dict)]),
        "minisgl-plugin-old",
        "0.0.9",
        requires=("torch>=2", "minisgl>=99,<100"),
    )
    with pytest.warns(
        PluginWarning,
        match=rf"plugin 'old' \(minisgl-plugin-old 0.0.9\) is incompatible: requires "
        rf"minisgl<100,>=99, but minisgl {core_version()} is installed",
    ):
        reg = load(old)
    info = next(p for p in reg.plugins if p.name == "old")
    assert info.status == "incompatible" and "requires minisgl" in info.error
    assert not reg.has("kv_pool", "old-pool")
    with pytest.raises(PluginError, match="is incompatible"):
        load(old, strict=True)


@pytest.mark.parametrize(
    ("requires", "compatible"),
    [
        (["minisgl>=0.1,<0.2"], True),
        (["minisgl>=0.2"], False),
        (["minisgl<0.1"], False),
        (["minisgl"], True),
        (["MiniSGL>=5"], False),
        (["minisgl>=5; extra == 'bench'"], True),  # only with an extra that is not installed
        (["numpy>=99"], True),
        (["not a requirement ((("], True),
    ],
)
def test_check_compatible(requires: list[str], compatible: bool) -> None:
    assert (check_compatible(requires, "0.1.0") == "") is compatible


def test_plugin_written_for_0_1_is_incompatible_and_says_what_to_do() -> None:
    old = PluginSource(
        "oldie",
        plugin("oldie", minisgl_kv_cache_pools=[KVPoolSpec(name="old-pool", factory=dict)]),
        "minisgl-plugin-oldie",
        "0.1.3",
        requires=("minisgl>=0.1,<0.2",),
    )
    with pytest.warns(PluginWarning) as record:
        reg = load(old)
    info = next(p for p in reg.plugins if p.name == "oldie")
    assert info.status == "incompatible" and not reg.has("kv_pool", "old-pool")
    assert info.error == (
        f"requires minisgl<0.2,>=0.1, but minisgl {core_version()} is installed: install a release of "
        f"minisgl-plugin-oldie made for minisgl {core_version()}, or disable it with MINISGL_DISABLE_PLUGINS=oldie"
    )
    assert [str(w.message) for w in record] == [
        f"plugin 'oldie' (minisgl-plugin-oldie 0.1.3) is incompatible: {info.error}; the plugin is skipped "
        "(set MINISGL_STRICT_PLUGINS=1 to make this fatal)"
    ]


# ------------------------------------------------ auto: pluggy's call order
def test_auto_follows_pluggy_call_order() -> None:
    """tryfirst > plain > trylast (the built-ins); within one plugin, its list order; priority beats both."""

    class First:
        @hookimpl(tryfirst=True)
        def minisgl_attention_backends(self) -> list[AttentionBackendSpec]:
            return [attn("fast", auto=True)]

    class Plain:
        @hookimpl
        def minisgl_attention_backends(self) -> list[AttentionBackendSpec]:
            return [attn("good", auto=True), attn("good-old", auto=True)]

        @hookimpl
        def minisgl_prefix_caches(self) -> list[PrefixCacheSpec]:
            return [PrefixCacheSpec(name="tree", factory=dict, auto=True)]

    plain = PluginSource("plain", Plain(), "plain-dist", "1.0")
    reg = load(PluginSource("zfirst", First(), "first-dist", "1.0"), plain)
    assert [s.name for s in reg.ranked("attention", "cpu")] == ["fast", "good", "good-old", "torch"]
    assert [s.name for s in reg.ranked("attention", "cuda")] == ["fast", "good", "good-old", "torch"]
    assert reg.pick("prefix_cache", "auto", "cpu").name == "tree"  # any plugin outranks the built-in 'naive'
    reg = load(plain)
    assert reg.pick("attention", "auto", "cuda").name == "good"
    late = source("late", minisgl_attention_backends=[attn("late", auto=True, priority=1)])
    assert load(PluginSource("zfirst", First(), "first-dist", "1.0"), late).pick("attention", "auto", "cpu").name == (
        "late"
    )


def test_auto_takes_only_specs_that_say_auto() -> None:
    """A component without auto=True is chosen only by name, whatever its hook marker or priority."""

    class Eager:
        @hookimpl(tryfirst=True)
        def minisgl_attention_backends(self) -> list[AttentionBackendSpec]:
            return [attn("slow-copy", priority=99)]

        @hookimpl(tryfirst=True)
        def minisgl_prefix_caches(self) -> list[PrefixCacheSpec]:
            return [PrefixCacheSpec(name="tree", factory=dict)]

    reg = load(PluginSource("eager", Eager(), "eager-dist", "1.0"))
    assert [s.name for s in reg.ranked("attention", "cpu")] == ["torch"]
    assert reg.pick("attention", "auto", "cpu").name == "torch"
    assert reg.pick("prefix_cache", "auto", "cpu").name == "naive"
    assert reg.pick("attention", "slow-copy", "cpu").name == "slow-copy"  # named, it is used
    reg = load(PluginSource("eager", Eager(), "eager-dist", "1.0"), env={"MINISGL_DISABLE_PLUGINS": "builtin"})
    with pytest.raises(UnknownComponentError) as info:
        reg.pick("prefix_cache", "auto", "cpu")
    assert str(info.value) == (
        "no installed prefix cache that 'auto' may choose supports device 'cpu'; installed: tree (eager-dist). "
        "tree can be named explicitly (a spec joins 'auto' with auto=True)"
    )
    with pytest.raises(TypeError, match=r"^AttentionBackendSpec.auto must be True or False, got 1$"):
        attn("x", auto=1)


# ----------------------------------------------------- unknown components
def test_unknown_name_lists_what_is_installed_and_where_to_look() -> None:
    reg = load()
    with pytest.raises(UnknownComponentError) as info:
        reg.get("attention", "flashinfer")
    assert str(info.value) == (
        "unknown attention backend 'flashinfer'; installed: torch (minisgl). 'flashinfer' is provided by "
        "minisgl-plugin-flashinfer: pip install minisgl-plugin-flashinfer. "
        "`minisgl plugins` lists each plugin and what it provides; docs/plugins.md says how to add one."
    )


@pytest.mark.parametrize(
    ("kind", "name", "dist"),
    [
        ("attention", "fi", "minisgl-plugin-flashinfer"),
        ("attention", "fa3", "minisgl-plugin-fa"),
        ("attention", "xqa", "minisgl-plugin-trtllm"),
        ("attention", "cpu", "minisgl-plugin-cpu"),
        ("kernels", "triton", "minisgl-plugin-triton"),
        ("kernels", "native", "minisgl-plugin-cpu"),
        ("prefix_cache", "radix", "minisgl-plugin-radix"),
        ("grammar", "xgrammar", "minisgl-plugin-xgrammar"),
        ("moe", "fused", "minisgl-plugin-qwen3-moe"),
        ("model", "Qwen2ForCausalLM", "minisgl-plugin-llama"),
    ],
)
def test_unknown_first_party_name_says_what_to_install(kind: Kind, name: str, dist: str) -> None:
    with pytest.raises(UnknownComponentError, match=f" '{name}' is provided by {dist}: pip install {dist}\\. "):
        load().get(kind, name)


def test_first_party_table_matches_what_the_plugins_declare() -> None:
    """Every name and alias a first-party plugin in this tree declares is in the table, with its distribution."""
    root = Path(__file__).parents[2] / "plugins"
    for pyproject in root.glob("minisgl-plugin-*/pyproject.toml"):
        dist = pyproject.parent.name
        entry = next(iter(tomllib.loads(pyproject.read_text())["project"]["entry-points"]["minisgl"].values()))
        sys.path.insert(0, str(pyproject.parent / "src"))
        before = set(sys.modules)
        try:
            module = importlib.import_module(entry)
        finally:
            sys.path.pop(0)
            # Forget the plugin's package again: a later test skips when it is not installed (importorskip).
            for name in set(sys.modules) - before:
                del sys.modules[name]
        for kind, hook in HOOKS.items():
            for spec in getattr(module, hook, lambda: [])():
                for name in (spec.name, *spec.aliases):
                    assert FIRST_PARTY[kind].get(name) == dist, (kind, name, dist)


def test_unknown_model_architecture() -> None:
    with pytest.raises(
        UnknownComponentError, match=r"^unknown model architecture 'Qwen3MoeForCausalLM'; installed: none\. "
    ):
        load().get("model", "Qwen3MoeForCausalLM")


def test_unknown_name_names_disabled_plugins_and_why() -> None:
    radix = source("radix", "minisgl-plugin-radix", minisgl_prefix_caches=[PrefixCacheSpec(name="radix", factory=dict)])
    reg = load(radix, env={"MINISGL_DISABLE_PLUGINS": "radix"})
    with pytest.raises(UnknownComponentError) as info:
        reg.pick("prefix_cache", "radix", "cpu")
    assert "Installed plugins that are not active: radix (disabled: listed in MINISGL_DISABLE_PLUGINS)." in str(
        info.value
    )
    assert "Did you mean" not in str(info.value)  # 'naive' is not close to 'radix'


def test_unknown_name_suggests_a_close_one_and_inactive_plugins() -> None:
    broken = PluginSource("broken", "no_such_module_for_minisgl.plugin", "minisgl-plugin-broken", "0.3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        reg = load(broken)
    with pytest.raises(UnknownComponentError) as info:
        reg.get("attention", "troch")
    assert str(info.value) == (
        "unknown attention backend 'troch'; installed: torch (minisgl). Did you mean 'torch'? "
        "Installed plugins that are not active: broken (failed: ModuleNotFoundError: No module named "
        "'no_such_module_for_minisgl'). `minisgl plugins` lists each plugin and what it provides; "
        "docs/plugins.md says how to add one."
    )
    with pytest.raises(UnknownComponentError, match=r"installed: torch \(minisgl\)\. Installed"):
        reg.get("attention", "paged")  # nothing close: no suggestion


def test_engine_facing_api_with_installed_plugins() -> None:
    """The engine calls load_plugins(config.plugins): built-ins are always there, installed or not."""
    reg = load_plugins(environ={"MINISGL_PLUGINS": ""})
    assert reg.active_plugin_names() == ["builtin"]
    assert reg.pick("attention", "auto", "cpu").name == "torch"
    assert reg.pick("prefix_cache", "auto", "cpu").name == "naive"
