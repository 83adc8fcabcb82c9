#!/bin/bash
# Alternate int4 floor_pairs runs: old code (f7ca411), new code with the bf16 pass, new code with the VNNI pass.
cd /work/main
for rep in 1 2 3; do
  for cfg in old new-bf16 new-vnni; do
    case $cfg in
      old) dir=/tmp/s15/old; env="";;
      new-bf16) dir=/work/main; env="SPECDECODE_INT4_KERNEL=bf16";;
      new-vnni) dir=/work/main; env="SPECDECODE_INT4_KERNEL=vnni";;
    esac
    echo "== $cfg rep $rep"
    (cd $dir && env $env PYTHONPATH=$dir python benchmarks/floor_pairs.py --formats int4 --rounds 3 2>&1 | grep -E '^\| [0-9]')
  done
done
