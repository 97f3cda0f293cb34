# Sourced by the recipes: `check_arguments USAGE LEAST "$@"` prints USAGE and exits 0 for -h or
# --help, and prints it on stderr and exits 2 for fewer than LEAST arguments.
check_arguments() {
  local usage=$1 least=$2
  shift 2
  case "${1:-}" in
    -h|--help) echo "$usage"; exit 0 ;;
  esac
  if (( $# < least )); then
    echo "$usage" >&2
    exit 2
  fi
}
