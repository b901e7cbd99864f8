#!/usr/bin/env bash
# Runs COMMAND on every worker of the TPU VM, in the project directory with its venv active,
# inside a detached tmux session (PSPEC_TPU_SESSION) that outlives the ssh connection. Output
# goes to ~/pspec_logs/SESSION.log on each worker, ending with the command's exit status; the
# session closes when the command ends. Follow it with logs.sh, end it early with stop.sh.
#
# Usage: tpu_scripts/launch.sh [--dry-run] [--] COMMAND...
#
#   --dry-run   print the gcloud command instead of running it
#   -h, --help  this text
#
# Example:
#   tpu_scripts/launch.sh -- python -m train.distill --config=configs/llama2_13b.py \
#     --workdir=gs://YOUR_BUCKET/llama2_13b
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here != "${BASH_SOURCE[0]}" ]] || here=.
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

parse_args "$@"
((${#ARGS[@]})) || die "no command given (see ${0##*/} --help)"
check_settings

log="$LOG_DIR/$PSPEC_TPU_SESSION.log"
job=". .venv/bin/activate && $(join_quoted "${ARGS[@]}") >> $log 2>&1; echo exit status \$? >> $log"
on_workers all "cd $(quote "$PSPEC_TPU_DIR") && mkdir -p $LOG_DIR && \
tmux new-session -d -s $PSPEC_TPU_SESSION $(dquote "$job")"
