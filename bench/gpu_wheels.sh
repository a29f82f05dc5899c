#!/bin/bash
# Wheels for the GPU machine (Python 3.12, torch on the image, no internet), into .whl/ (git-ignored
# through .git/info/exclude): ray without its Java jar and source maps (to fit the 64 MiB transfer),
# megatron-core, TRL 1.12 (the last release with PPOTrainer), gguf (SmolLM2's conversion), peft (bench/lora.py) and what they need beyond
# the image.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
pip_get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
pip_get ray==2.60.0 megatron-core==0.19.2 trl==1.12.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 \
  jsonschema jsonschema-specifications referencing rpds-py submitit pydantic pydantic-core annotated-types typing-inspection \
  gguf==0.19.0 peft==0.21.2
tmp=$(mktemp -d)
(cd "$tmp" && unzip -q "$OLDPWD"/.whl/ray-2.60.0-*.whl && find . \( -name '*.jar' -o -name '*.map' \) -delete &&
 python3 -c "import os; r=[d for d in os.listdir('.') if d.endswith('.dist-info')][0]+'/RECORD'; \
open(r+'.new','w').writelines(l for l in open(r) if os.path.exists(l.split(',')[0])); os.replace(r+'.new', r)" &&
 rm "$OLDPWD"/.whl/ray-2.60.0-*.whl && zip -q -r -9 "$OLDPWD"/.whl/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl .)
rm -rf "$tmp"
du -sh .whl
