#!/usr/bin/env bash
# Wheels for benchmarks/speed/gpu_side_by_side.py on a GPU machine without network access (issue 32).
#
#   bash benchmarks/tools/gpu_wheels.sh            # here, with network: download into benchmarks/.wheels (git-ignored)
#   bash benchmarks/tools/gpu_wheels.sh install    # there: install them offline into /tmp/lmppo-site, print PYTHONPATH
#
# The bare image holds torch, accelerate, pyarrow, pandas, xxhash, safetensors, peft and an older transformers; it
# lacks TRL, datasets (with dill and multiprocess), pydantic (with pydantic-core, annotated-types,
# typing-inspection) and transformers >= 5.24 (with the tokenizers and huggingface_hub 2.x it needs, and the hub's
# httpx2, httpcore2, truststore, anyio, idna, h11, click and hf-xet; accelerate and peft are carried too, at the
# versions that go with it). Wheels are cp312 manylinux x86_64, pinned to the versions lmppo's own venv runs; pyarrow (about 40 MiB) is left out: the image has it.
# The SmolLM2 tokenizer files go beside them (the side-by-side needs only the tokenizer: the models are random).
# Everything together must stay under 64 MiB (what a device call carries); the download step checks it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR="${GPU_WHEELS_DIR:-$ROOT/benchmarks/.wheels}"
SITE="${GPU_SITE_DIR:-/tmp/lmppo-site}"
PY="${PYTHON:-python3}"
LIMIT_MIB=64
WHEELS=(
  "transformers==5.24.0" "tokenizers==0.23.3" "huggingface_hub==2.4.0" "safetensors==0.8.0" "accelerate==1.15.0"
  "peft==0.21.2"
  "trl==1.12.*" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19"
  "pydantic==2.14.4" "pydantic_core==2.50.5" "annotated-types" "typing-inspection==0.4.5"
  "httpx2==2.16.2" "httpcore2==2.16.2" "truststore==0.10.5" "anyio==4.16.0" "idna==3.20" "h11==0.16.0"
  "click==8.5.1" "hf-xet==1.8.0"
)
TOKENIZER="${SMOLLM2_TOKENIZER:-$HOME/.cache/lmppo/models/smollm2-135m-instruct}"

download() {
  mkdir -p "$DIR/tokenizer"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$DIR" "${WHEELS[@]}"
  for f in tokenizer.json tokenizer_config.json special_tokens_map.json; do
    if [ -f "$TOKENIZER/$f" ]; then cp "$TOKENIZER/$f" "$DIR/tokenizer/"; fi
  done
  [ -f "$DIR/tokenizer/tokenizer.json" ] || { echo "error: no SmolLM2 tokenizer.json in $TOKENIZER (set SMOLLM2_TOKENIZER)"; exit 2; }
  du -ah "$DIR" | sort -h | tail -n 20
  local kib; kib=$(du -sk "$DIR" | cut -f1)
  echo "total: $((kib / 1024)) MiB (limit $LIMIT_MIB MiB)"
  if [ "$kib" -gt $((LIMIT_MIB * 1024)) ]; then echo "error: $DIR is over $LIMIT_MIB MiB"; exit 3; fi
}

install() {
  ls "$DIR"/*.whl >/dev/null 2>&1 || { echo "error: no wheels in $DIR (run this script with no argument where there is network)"; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$DIR"/*.whl
  echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
}

case "${1:-download}" in
  download) download ;;
  install) install ;;
  *) echo "usage: $0 [download|install]"; exit 2 ;;
esac
