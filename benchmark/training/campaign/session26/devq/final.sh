# Session 26, after training (GPU free): the goal's chat command, 8 rows, the new draft then the bundled one.
. .devq/common.sh
bench s26-chat-rows8-new 8 /tmp/train_out/checkpoint 240 --chat
