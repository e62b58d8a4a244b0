#!/usr/bin/env bash
# The lent H200 made ready for deltafin (run there, in the repository root, in the second device
# call of ../shared/device/README.md, carrying .devwheels/b). Here, first:
#   ../shared/device/prepare-mlx-cuda.sh mlx-lm==0.32.2 isal pytest-timeout
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 -d .devwheels/b llguidance==1.9.1   # the supervisor imports it
# then device call 1 (carry .devwheels/a): mkdir -p /root/w && cp .devwheels/a/* /root/w/
# and at once call 2 (carry .devwheels/b): bash docs/probes/h200_setup.sh && bash docs/probes/h200_partial.sh split
# It installs MLX CUDA and the wheels into /tmp/site, maps the deltafin namespace onto this tree in
# /tmp/ns (what the package-dir mapping does when installed), and builds issue 28's store in
# /tmp/store once per machine (not with SETUP_STORE=0). Later calls on the same machine skip what is there.
set -euo pipefail
if [ ! -d /tmp/site/mlx ]; then
  cat /root/w/mlx_cuda.part00 .devwheels/b/mlx_cuda.part01 > "/root/w/$(cat .devwheels/b/mlx_cuda.name)"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/w/*.whl
fi
if [ ! -d /tmp/site/llguidance ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/b/*.whl
fi
rm -rf /tmp/ns && mkdir -p /tmp/ns/deltafin
for d in runtime workers protocol tools configs; do ln -s "$PWD/$d" "/tmp/ns/deltafin/$d"; done
ln -s "$PWD/protocol/client" /tmp/ns/deltafin/client
export PYTHONPATH=/tmp/site:/tmp/ns PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
if [ "${SETUP_STORE:-1}" = 1 ] && [ ! -f /tmp/store/manifest.json ]; then
  python3 -m deltafin.tools.synth tiny qwen3_moe /tmp/hf --layers 8 --experts 32 --top-k 4 --hidden 1024 \
    --moe-intermediate 768 --vocab 8192 --dtype bfloat16 --init hf > /tmp/synth.log 2>&1
  python3 -m deltafin.tools.convert /tmp/hf /tmp/store --no-progress > /tmp/convert.log 2>&1
fi
echo "store: $(ls /tmp/store | wc -l) files"
