# Session 44, one device call: HEAD's code (staged as head.tar, so a call never sees the working
# tree's unfinished edits) runs the campaign's phases (session40/devq/loop.sh: scripts/
# h200_session.sh back to back within the call) with this folder's env and final.sh as .devq/.
#   N=<the last chunk> bash benchmark/training/campaign/session44/devq/run.sh
# Later sessions reuse it with their own env: DEVQ=<their folder holding env> (session 47 on).
set -u
source .device/$N/activate.sh > /dev/null || exit 1
H=/tmp/head
mkdir -p $H && [ -f $H/pyproject.toml ] || tar xf /tmp/stage/files/head.tar -C $H
mkdir -p $H/.device/$N $H/.devq && cp .device/$N/activate.sh $H/.device/$N/
D=benchmark/training/campaign
# env and final.sh from the carried tree (settings, changeable without staging again); the code from HEAD
cp ${DEVQ:-$D/session44/devq}/env $D/session44/devq/final.sh $H/.devq/ && cp $H/$D/session26/devq/common.sh $H/.devq/
# a DEVQ folder's own job.sh (the session's GPU work before the data phase, once) and final.sh
for f in job.sh final.sh; do [ -f "${DEVQ:-$D/session44/devq}/$f" ] && cp "${DEVQ:-$D/session44/devq}/$f" $H/.devq/; done
cd $H && OUT=$OUT bash $D/session40/devq/loop.sh
