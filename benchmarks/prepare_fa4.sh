#!/usr/bin/env bash
# Prepare FlashAttention-4 (flash_attn.cute) for a GPU machine that has no network and takes at
# most 64 MiB of files per call. Run here, in the repository root; writes only git-ignored folders.
#
#   bash benchmarks/prepare_fa4.sh            # -> .fa4a/ and .fa4b/, each under 60 MB
#
# The CUTLASS DSL runtime wheel is ~92 MB, so the wheels travel in two halves over two calls on
# a warm machine (it stays warm ~30 s between calls; /tmp survives between them):
#   call 1, carry [".fa4a"]:  mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/
#   call 2, carry [".fa4b"]:  cp .fa4b/* /tmp/fa4/ && bash .fa4b/install.sh && <run the suite>
# install.sh joins the parts, installs into /tmp/site and prints the PYTHONPATH to export.
# Versions: the ones measured to fit Python 3.12 / CUDA 13 machines; adjust together.
set -euo pipefail
FA4=${FA4:-flash-attn-4==4.0.0b36}
DSL=${DSL:-nvidia-cutlass-dsl==4.8.1}
# flash-attn-4's own requirements that the GPU machine's torch does not bring
DEPS=(${DEPS:-"quack-kernels>=0.5.3" "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext})
work=$(mktemp -d)
common=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work")
python3 -m pip download "${common[@]}" "$FA4" "$DSL" "${DEPS[@]}"
# the DSL's libraries come as their own distributions: base (and core, where a release has it)
# and the CUDA-13 runtime (an extra); name them from the DSL's metadata
for whl in "$work"/nvidia_cutlass_dsl-*.whl; do
  unzip -p "$whl" '*/METADATA' | sed -n -e 's/^Requires-Dist: \(nvidia-cutlass-dsl-libs-\(base\|core\)[^;]*\)$/\1/p' \
    -e 's/^Requires-Dist: \(nvidia-cutlass-dsl-libs-cu13[^;]*\);.*$/\1/p'
done | sort -u | while read -r req; do python3 -m pip download "${common[@]}" "$req"; done
mkdir -p .fa4a .fa4b
rm -f .fa4a/* .fa4b/*
tar -C "$work" -cf - . | split -b 55m - .fa4a/part.
mv .fa4a/part.ab .fa4b/ 2>/dev/null || true
for extra in .fa4a/part.a[c-z]; do [ -e "$extra" ] && { echo "more than two parts: $extra" >&2; exit 1; }; done
cat > .fa4b/install.sh <<'INNER'
set -e
cat /tmp/fa4/part.* | tar -C /tmp/fa4 -xf -
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/fa4/*.whl
echo "export PYTHONPATH=/tmp/site"
INNER
du -sh .fa4a .fa4b
grep -qx '/.fa4a/' .git/info/exclude 2>/dev/null || printf '/.fa4a/\n/.fa4b/\n' >> .git/info/exclude
