# Session 37, call E: where the daemon's GPU gap (0.71x of in-process in call D) comes from:
# in-process, in-process on a thread of its own, the daemon, the daemon without its prefix cache
. .devq/common.sh > /dev/null 2>&1
bash scripts/h200_pair.sh ptxrestore
export DFLASH_BRANCHES=8
timeout 400 python3 -m dflash.daemon.bench --model $M --draft /tmp/stage/files/bundled --out $OUT/daemon-bench-variants-s37.json \
  --max-tokens 256 --repeats 3 --variants inproc,thread,daemon,daemon-nocache,inproc > $OUT/daemon-bench-variants-s37.log 2>&1
echo "rc $?"; grep -E '^(inproc|thread|daemon|daemon-nocache):' $OUT/daemon-bench-variants-s37.log; tail -n 5 $OUT/daemon-bench-variants-s37.log
