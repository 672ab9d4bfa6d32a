# shellcheck shell=bash
# apt_install PACKAGE...: installs Debian packages without a question, without needrestart's
# check after the install (on a machine without a terminal it prints Perl warnings, and no
# daemon here needs restarting for a new package), and without apt's and debconf's chatter:
# what apt printed is shown only when the install failed. Sourced by the scripts that install.
apt_install() {
  local out
  export DEBIAN_FRONTEND=noninteractive NEEDRESTART_MODE=a NEEDRESTART_SUSPEND=1
  if [ -z "${APT_UPDATED:-}" ]; then
    if ! out="$(apt-get update -qq 2>&1)"; then
      printf '%s\n' "$out" >&2
      echo "apt-get update failed (above): is a Debian mirror reachable?" >&2
      return 1
    fi
    APT_UPDATED=1
    export APT_UPDATED
  fi
  if ! out="$(apt-get install -y -qq -o Dpkg::Use-Pty=0 "$@" 2>&1)"; then
    printf '%s\n' "$out" >&2
    echo "apt-get install $* failed (above)" >&2
    return 1
  fi
}
