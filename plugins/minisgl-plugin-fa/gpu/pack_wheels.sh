#!/usr/bin/env bash
# Prepare FlashAttention 4 for a GPU machine that has no package registry (run here, from the repo root).
#
# Downloads the version set that runs on an H200 (Python 3.12, torch 2.11 + CUDA 13) and lays it out in
# two git-ignored folders, one per device call, each under the 64 MiB a call may carry:
#   plugins/minisgl-plugin-fa/build/gpu-a/  first part of the CuTe DSL compiler (call A, run_h200.sh stage)
#   plugins/minisgl-plugin-fa/build/gpu-b/  the rest: second part, small wheels, checksums (call B)
# The DSL compiler (nvidia-cutlass-dsl-libs-cu13, a 92 MB wheel) travels as an xz tarball of the wheel's
# files (61 MB), split in 24 MiB parts (the first goes in call A); run_h200.sh joins, checks, unpacks it.
set -euo pipefail
root=plugins/minisgl-plugin-fa/build
work=${FA_WHEEL_CACHE:-/tmp/fa-wheels-cp312}
mkdir -p "$work" "$root/gpu-a" "$root/gpu-b"
rm -rf "$root"/gpu-a/* "$root"/gpu-b/*
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
small=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
       quack-kernels==0.6.5 einops==0.8.2)
for p in "${small[@]}" nvidia-cutlass-dsl-libs-cu13==4.8.1; do
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$work" "$p"
done
for w in flash_attn_4-4.0.0b36 nvidia_cutlass_dsl_libs_base-4.8.1 nvidia_cutlass_dsl_libs_core-4.8.1 \
         quack_kernels-0.6.5 einops-0.8.2; do
  cp "$work"/"$w"-*.whl "$root/gpu-b/"
done
# torch 2.11 depends on cuda-bindings 13, which the DSL needs too; run_h200.sh installs these only if it is missing.
mkdir -p "$root/gpu-b/fallback"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$root/gpu-b/fallback" "cuda-bindings>=13.0.3,<14" cuda-pathfinder
cu13=$(ls "$work"/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-*.whl)
tarball="$work/cutlass-dsl-cu13-4.8.1.tar.xz"
if [ ! -s "$tarball" ]; then
  rm -rf "$work/cu13" && mkdir -p "$work/cu13"
  python3 -m zipfile -e "$cu13" "$work/cu13"
  # Only the package files (the dist-info is not needed to import it); -9e: 92 MB deflate -> 61 MB.
  tar -C "$work/cu13" -cf - nvidia_cutlass_dsl | xz -9e -T2 > "$tarball.tmp" && mv "$tarball.tmp" "$tarball"
fi
(cd "$work" && sha256sum "$(basename "$tarball")") > "$root/gpu-b/SHA256SUMS"
split -b 24M -d -a 1 "$tarball" "$root/gpu-b/cu13.part"
mv "$root/gpu-b/cu13.part0" "$root/gpu-a/"
du -sh "$root/gpu-a" "$root/gpu-b"
ls -l "$root/gpu-a" "$root/gpu-b"
