# Session 26, GPU idle before training: the default pair at first-time cache lengths (raw text), 8 rows then 1.
. .devq/common.sh
for r in 8 1; do bench s26-firsttime-rows$r $r /tmp/stage/files/draft 160 --contexts 128,1024; done
