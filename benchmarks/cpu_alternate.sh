#!/usr/bin/env bash
# CPU offline throughput of this tree against a baseline tree, alternating round by round so that both
# share whatever else the machine is doing. Run from the repository root in the development venv (this
# tree and its plugins installed editable). BASE is an unpacked `git archive COMMIT core plugins`; it runs
# from PYTHONPATH with dist-info metadata of its own, ahead of this tree's, and with this tree's plugins
# that the baseline does not have blocked (MINISGL_DISABLE_PLUGINS).
# Usage: [BASE_COMMIT=SHA MINISGL_COMMIT=SHA] benchmarks/cpu_alternate.sh BASE OUT [ROUNDS]
# (results: OUT/offline-cpu-{base,new}-N.json; the two variables name the trees in them)
set -euo pipefail
BASE=${1:?baseline tree}; OUT=${2:?output folder}; ROUNDS=${3:-8}
mkdir -p "$OUT"
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
python3 benchmarks/dist_info.py "$BASE" "$SITE"
BASE_PATH=$SITE:$PWD/$BASE/core/src
for src in "$BASE"/plugins/minisgl-plugin-*/src; do BASE_PATH=$BASE_PATH:$PWD/$src; done
# This tree's plugins the baseline does not ship (their entry names), kept out of the baseline's runs.
NEW_ONLY=$(python3 benchmarks/dist_info.py --new-only "$BASE")
for round in $(seq 1 "$ROUNDS"); do
  PYTHONPATH=$BASE_PATH MINISGL_DISABLE_PLUGINS=$NEW_ONLY MINISGL_COMMIT=${BASE_COMMIT:-base} \
    python3 -m minisgl bench offline --workload cpu --no-baseline --output "$OUT" --label "offline-cpu-base-$round"
  python3 -m minisgl bench offline --workload cpu --no-baseline --output "$OUT" --label "offline-cpu-new-$round"
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, pathlib, statistics, sys
out, rounds = pathlib.Path(sys.argv[1]), int(sys.argv[2])
def tps(label: str) -> float:
    results = json.loads((out / f"{label}.json").read_text())["results"]
    return next(r["throughput_tok_s"] for r in results if r["system"] == "minisgl")
rows = [(r, tps(f"offline-cpu-base-{r}"), tps(f"offline-cpu-new-{r}")) for r in range(1, rounds + 1)]
print("| round | base tok/s | new tok/s |\n| ---: | ---: | ---: |")
for r, b, n in rows:
    print(f"| {r} | {b:.1f} | {n:.1f} |")
print(f"| **median** | **{statistics.median(b for _, b, _ in rows):.1f}** | **{statistics.median(n for _, _, n in rows):.1f}** |")
PY
