# Session 39, call D (an H200): (1) a fresh daemon's status on a GPU after the accel change (it named MKL
# before); (2) the weight-averaged draft (soup B) against the bundled one on the GPU: held-out
# bf16 256 tokens one row, and in one process on mlx-lm's own texts
. .devq/common.sh > /dev/null 2>&1
bash scripts/h200_pair.sh ptxrestore
B=/tmp/stage/files/bundled; SOUP=/tmp/stage/files/B
export DFLASH_BRANCHES=8
S=/tmp/dstate2; R=/tmp/drun2; mkdir -p $S $R; chmod 700 $R
timeout 120 python3 -m dflash.daemon.cli start --model $M --draft $B --state-dir $S --runtime-dir $R; echo "start rc $?"
python3 -m dflash.daemon.cli status --runtime-dir $R > $OUT/daemon-status-s39d.txt 2>&1; grep -n "accelerator" $OUT/daemon-status-s39d.txt
timeout 60 python3 -m dflash.client.cli --endpoint ipc://$R/worker.sock prompt --stats --max-tokens 64 "Explain how a refrigerator keeps food cold." 2>&1 | tail -n 2
python3 -m dflash.daemon.cli stop --runtime-dir $R
for d in soup:$SOUP bundled:$B; do n=${d%%:*}; p=${d#*:}
  timeout 150 python3 -m dflash.engine.cli eval-draft --target $M --draft $p --max-tokens 256 --dtype bfloat16 --rows 1 \
    --out $OUT/heldout-gpu-bf16-256-$n.json > $OUT/heldout-gpu-$n.log 2>&1; echo "eval $n rc $?"; grep overall $OUT/heldout-gpu-$n.log
done
timeout 240 python3 scripts/arms_ab.py --model $M --draft $B --dtype bfloat16 --baseline --teach --heldout 11 --rounds 2 \
  --max-tokens 256 --arm bundled --arm soup:draft=$SOUP --out $OUT/arms-ab-soup-s39-h200.json > $OUT/arms-ab-soup-s39-h200.log 2>&1
echo "arms rc $?"; tail -n 12 $OUT/arms-ab-soup-s39-h200.log
