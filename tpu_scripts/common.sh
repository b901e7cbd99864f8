# shellcheck shell=bash
# Helpers every tpu_scripts/ script sources: settings, argument parsing, and `run`, which prints
# a command instead of running it under --dry-run. Only bash builtins are used before `run`
# executes anything, so a dry run needs neither gcloud nor any other program.

# shellcheck disable=SC2034  # DRY_RUN, ARGS, ROOT, LOG_DIR are read by the scripts sourcing this.

TPU_SCRIPTS_DIR=$(cd -P "${BASH_SOURCE[0]%/*}" && pwd)
ROOT=$(cd -P "$TPU_SCRIPTS_DIR/.." && pwd)
# shellcheck source=tpu_scripts/settings.sh
source "$TPU_SCRIPTS_DIR/settings.sh"

DRY_RUN=0
ARGS=()  # what follows the options (or `--`)
# On every worker, where the tilde expands (not here).
# shellcheck disable=SC2088
LOG_DIR='~/pspec_logs'

die() {
  printf '%s: %s\n' "${0##*/}" "$*" >&2
  exit 1
}

# Prints the calling script's header comment (the lines after the shebang that start with #).
usage() {
  local line
  {
    read -r line  # the shebang
    while IFS= read -r line && [[ $line == '#'* ]]; do
      line=${line#'#'}
      printf '%s\n' "${line# }"
    done
  } <"$0"
}

# parse_args "$@": handles --dry-run and -h/--help; any other option goes to the script's own
# `option` function (which returns non-zero if it does not know it). The first word that is
# not an option, or everything after `--`, ends up in ARGS.
parse_args() {
  while (($#)); do
    case $1 in
      --dry-run) DRY_RUN=1 ;;
      -h | --help)
        usage
        exit 0
        ;;
      --)
        shift
        break
        ;;
      -*)
        if ! declare -F option >/dev/null || ! option "$1"; then
          die "unknown option '$1' (see ${0##*/} --help)"
        fi
        ;;
      *) break ;;
    esac
    shift
  done
  ARGS=("$@")
}

# After parse_args, for scripts that take no arguments: stops on the first one given.
no_args() {
  ((${#ARGS[@]} == 0)) || die "unexpected argument '${ARGS[0]}' (see ${0##*/} --help)"
}

# Stops with one clear line when a setting is missing or malformed, or gcloud is needed but absent.
check_settings() {
  local name
  for name in PSPEC_TPU_PROJECT PSPEC_TPU_ZONE PSPEC_TPU_TYPE PSPEC_TPU_NAME PSPEC_TPU_RUNTIME \
    PSPEC_TPU_PYTHON PSPEC_TPU_DIR PSPEC_TPU_SESSION; do
    [[ -n ${!name} ]] || die "$name is not set: export $name=... (see tpu_scripts/settings.sh)"
  done
  for name in PSPEC_TPU_QUEUED PSPEC_TPU_SPOT; do
    [[ ${!name} == [01] ]] || die "$name must be 0 or 1, got '${!name}'"
  done
  [[ $PSPEC_TPU_SESSION =~ ^[A-Za-z0-9_-]+$ ]] ||
    die "PSPEC_TPU_SESSION must be letters, digits, _ or -, got '$PSPEC_TPU_SESSION'"
  if ((!DRY_RUN)) && ! command -v gcloud >/dev/null; then
    die "gcloud not found: install the Google Cloud CLI, or add --dry-run to print the commands"
  fi
}

# quote WORD: WORD as one shell word (unchanged when it needs no quoting). A `name=` or
# `--flag=` prefix stays outside the quotes, so assignments and flags read as usual.
quote() {
  local word=$1 prefix=''
  if [[ $word =~ ^[A-Za-z0-9_./:,@%+=-]+$ ]]; then
    printf '%s' "$word"
    return
  fi
  if [[ $word =~ ^([A-Za-z0-9_./:,@%+-]+=)(.+)$ ]]; then
    prefix=${BASH_REMATCH[1]}
    word=${BASH_REMATCH[2]}
  fi
  if [[ $word != *"'"* ]]; then
    printf "%s'%s'" "$prefix" "$word"
  elif [[ $word != *[\"\$\`\\!]* ]]; then
    printf '%s"%s"' "$prefix" "$word"
  else
    printf "%s'%s'" "$prefix" "${word//\'/\'\\\'\'}"
  fi
}

# dquote STRING: STRING inside double quotes, to run later by a shell that reads it again.
dquote() {
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//\$/\\\$}
  s=${s//\`/\\\`}
  printf '"%s"' "$s"
}

# join_quoted WORD...: the words quoted and joined by spaces (one command line).
join_quoted() {
  local out='' word
  for word in "$@"; do
    out+="${out:+ }$(quote "$word")"
  done
  printf '%s' "$out"
}

# run COMMAND...: under --dry-run prints the command line on stdout; otherwise echoes it to
# stderr with a `+ ` prefix and runs it.
run() {
  if ((DRY_RUN)); then
    printf '%s\n' "$(join_quoted "$@")"
  else
    printf '+ %s\n' "$(join_quoted "$@")" >&2
    "$@"
  fi
}

# The flags that place every gcloud command.
tpu_flags() {
  TPU_FLAGS=("--project=$PSPEC_TPU_PROJECT" "--zone=$PSPEC_TPU_ZONE")
}

# on_workers WORKER COMMAND: runs the shell command COMMAND on worker WORKER (a number or all).
on_workers() {
  tpu_flags
  run gcloud compute tpus tpu-vm ssh "$PSPEC_TPU_NAME" "${TPU_FLAGS[@]}" "--worker=$1" \
    "--command=$2"
}

# Copies the working tree (no .git, virtual environments, data, workdirs or caches) into
# PSPEC_TPU_DIR on every worker, as one tarball. Files deleted here stay there.
sync_tree() {
  local tarball="${TMPDIR:-/tmp}/${PSPEC_TPU_NAME}_sync.tar.gz" remote=pspec_sync.tar.gz
  local dir
  dir=$(quote "$PSPEC_TPU_DIR")
  tpu_flags
  run tar -czf "$tarball" --exclude=./.git --exclude=./.venv --exclude=./data \
    --exclude=./workdirs --exclude=./bench_results --exclude=./build --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude=.pytest_cache --exclude=.ruff_cache -C "$ROOT" .
  run gcloud compute tpus tpu-vm scp "$tarball" "$PSPEC_TPU_NAME:$remote" "${TPU_FLAGS[@]}" \
    --worker=all
  on_workers all "mkdir -p $dir && tar -xzf $remote -C $dir && rm $remote"
  run rm -f "$tarball"
}
