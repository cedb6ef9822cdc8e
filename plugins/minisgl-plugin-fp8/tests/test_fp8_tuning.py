"""The load-time GEMM tuning's choices (CPU: candidates are PyTorch functions, the timer a stated cost table)."""

from __future__ import annotations

import pytest
import torch
from minisgl_plugin_fp8.config import ONLINE, FP8Scheme
from minisgl_plugin_fp8.method import FP8Method
from minisgl_plugin_fp8.tuning import Candidate, GemmTable, GemmTuner, describe

BUCKETS = (16, 64, 256, 1024)


def _exact(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, w * s[:, None], b)


def _noisy(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = _exact(x, w, s, b)
    return y + 0.01 * y.std() * torch.randn_like(y)  # within the bound (1 %)


def _wrong(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.zeros(x.shape[0], w.shape[0])


def _broken(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    raise RuntimeError("no kernel image is available for execution on the device\nmore detail")


class CostTimer:
    """Milliseconds per (candidate function, tokens) from ``cost``; counts the calls."""

    def __init__(self, cost: dict[object, object]) -> None:
        self.cost, self.calls = cost, 0

    def __call__(self, fn, m: int) -> float:  # noqa: ANN001
        self.calls += 1
        fn()  # the tuner passes the bound call: it must run
        cost = self.cost[fn.func]
        return float(cost(m) if callable(cost) else cost)  # type: ignore[operator]


def _tune(candidates: list[Candidate], timer: CostTimer, key: object = "k") -> tuple[GemmTable, GemmTuner]:
    torch.manual_seed(0)
    w, s = torch.randn(48, 32), torch.rand(48) + 0.5
    tuner = GemmTuner(BUCKETS, timer=timer)
    ref = lambda x: _exact(x, w, s, None)  # noqa: E731
    return tuner.table(key, candidates, w, s, None, ref, torch.float32), tuner


def test_each_bucket_gets_its_fastest_candidate() -> None:
    timer = CostTimer({_exact: lambda m: m * 1.0, _noisy: lambda m: 40 + m * 0.5})
    table, tuner = _tune([Candidate("default", _exact), Candidate("other", _noisy)], timer)
    assert table.names == ("default", "default", "other", "other")  # 16: 16 < 48; 64: 64 < 72; 256: 296 > 168
    assert table.pick(1) is _exact and table.pick(16) is _exact and table.pick(17) is _exact
    assert table.pick(65) is _noisy and table.pick(10**6) is _noisy  # past the last bucket: the last choice
    assert table.name_at(200) == "other" and table.describe() == "<=64 default, >64 other"
    assert all(0 <= r["rel_err"] < 0.05 for r in tuner.results)
    assert tuner.summary() == {"k": "<=64 default, >64 other"}


def test_a_table_is_tuned_once_per_key_and_rebuilt_for_other_candidates() -> None:
    timer = CostTimer({_exact: 1.0, _noisy: 2.0})
    cands = [Candidate("default", _exact), Candidate("other", _noisy)]
    w, s = torch.randn(48, 32), torch.rand(48) + 0.5
    tuner = GemmTuner(BUCKETS, timer=timer)
    ref = lambda x: _exact(x, w, s, None)  # noqa: E731
    tuner.table("a", cands, w, s, None, ref, torch.float32)
    calls = timer.calls
    again = tuner.table("a", cands, w, s, None, ref, torch.float32)  # the next layer of the shape
    assert timer.calls == calls and again.names == ("default",) * 4
    tuner.table("b", cands, w, s, None, ref, torch.float32)  # another shape
    assert timer.calls == 2 * calls
    # A table naming a candidate this call does not offer is tuned again rather than half-built.
    other = tuner.table("a", [Candidate("other", _noisy)], w, s, None, ref, torch.float32)
    assert timer.calls == 2 * calls + len(BUCKETS) and other.names == ("other",) * 4


def test_wrong_and_failing_candidates_are_never_chosen_and_say_why() -> None:
    timer = CostTimer({_exact: 5.0, _wrong: 0.1, _broken: 0.1})
    table, tuner = _tune(
        [Candidate("default", _exact), Candidate("zeros", _wrong), Candidate("broken", _broken)], timer
    )
    assert table.names == ("default",) * len(BUCKETS) and table.describe() == "any default"
    why = {r["candidate"]: r.get("skipped", "") for r in tuner.results}
    assert why["zeros"].startswith("relative error 1 >")
    assert why["broken"] == "RuntimeError: no kernel image is available for execution on the device"
    assert timer.calls == len(BUCKETS), "only the working candidate was timed"


def test_candidates_are_tried_only_where_they_fit_and_the_default_stands_when_nothing_works() -> None:
    timer = CostTimer({_exact: 5.0, _noisy: 1.0})
    table, tuner = _tune([Candidate("default", _exact), Candidate("small", _noisy, lambda m: m <= 64)], timer)
    assert table.names == ("small", "small", "default", "default")
    assert {r["m"] for r in tuner.results if r["candidate"] == "small"} == {16, 64}
    table, _ = _tune([Candidate("default", _broken)], CostTimer({}))
    assert table.names == ("default",) * len(BUCKETS)  # the default is kept (it fails the same way without tuning)


def test_describe_merges_neighbouring_buckets() -> None:
    assert describe((16, 64, 256, 1024), ("a", "a", "b", "c")) == "<=64 a, <=256 b, >256 c"
    assert describe((16, 64, 256), ("a", "b", "b")) == "<=16 a, >16 b"
    assert describe((16,), ("a",)) == "any a"


@pytest.mark.parametrize(
    ("scheme", "dtype", "default"),
    [(ONLINE, torch.bfloat16, "scaled_mm"), (FP8Scheme("fp8", "block", "weight_scale_inv", (128, 128)),
                                              torch.bfloat16, "block"), (ONLINE, torch.float32, "scaled_mm")],
)  # fmt: skip
def test_the_method_offers_its_default_first_and_weight_only_only_to_16_bit_models(
    scheme: FP8Scheme, dtype: torch.dtype, default: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minisgl_plugin_fp8 import kernels

    monkeypatch.setattr(kernels, "triton_available", lambda: True)  # the list, not the kernels, is under test
    names = [c.name for c in FP8Method(scheme, dtype, torch.device("cpu")).candidates(default)]  # type: ignore[arg-type]
    assert names[0] == default and len(names) == len(set(names))
    assert ("weight_only" in names) == (dtype != torch.float32)
    if default == "scaled_mm":
        assert {"scaled_mm_fast", "tensor_epi"} <= set(names) and sum(n.startswith("w8a8_") for n in names) >= 5
    else:
        assert not any(n.startswith(("w8a8", "scaled_mm", "tensor")) for n in names)


def test_tuning_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl_plugin_fp8.method import fp8_method

    assert fp8_method(None, torch.bfloat16, torch.device("cpu")).tune
    monkeypatch.setenv("MINISGL_FP8_TUNE", "0")
    assert not fp8_method(None, torch.bfloat16, torch.device("cpu")).tune
    assert not FP8Method(ONLINE, torch.bfloat16, torch.device("cpu"), paths=("w8a8",)).tune  # a forced path
