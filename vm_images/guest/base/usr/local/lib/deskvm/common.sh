# deskvm: shell functions shared by the desktop scripts (/usr/local/lib/deskvm/desktop of
# each desktop file set). Sourced by bash, never run. Under TCG every process start is
# expensive: waits use bash builtins, not sleep/poll tools.
#
#   mark MESSAGE          milestone on stderr (the console), stamped with the guest's uptime
#   fail MESSAGE          DESKVM_ERROR MESSAGE on the guest log, then exit 1
#   nap SECONDS           sleep without starting a process
#   screen_size           the X screen size as WxH (xrandr)
#   set_screen_size W H   make the X screen W x H (a cvt mode if the output lacks it)

GUEST_LOG=/dev/ttyS1

mark() {
    read -r uptime_s _ </proc/uptime
    echo "deskvm-desktop: ${uptime_s}s $*" >&2
}

fail() {
    echo "deskvm-desktop: $*" >&2
    printf 'DESKVM_ERROR %s\n' "$*" >"$GUEST_LOG"
    exit 1
}

# A sleep without a process: read from a pipe nobody writes, with a timeout.
exec {nap_fd}<> <(:)
nap() { read -r -t "$1" -u "$nap_fd" _ || true; }

screen_size() {
    xrandr --current 2>/dev/null | sed -n 's/^Screen 0:.* current \([0-9]*\) x \([0-9]*\),.*/\1x\2/p'
}

set_screen_size() {
    local want="$1x$2" state output modeline
    state=$(xrandr --current 2>/dev/null) || return 1
    [[ $state =~ current\ ([0-9]+)\ x\ ([0-9]+), ]] &&
        [ "${BASH_REMATCH[1]}x${BASH_REMATCH[2]}" = "$want" ] && return 0
    output=$(awk '$2 == "connected" { print $1; exit }' <<<"$state")
    [ -n "$output" ] || output=$(awk '$2 == "disconnected" { print $1; exit }' <<<"$state")
    [ -n "$output" ] || return 1
    if ! xrandr --output "$output" --mode "$want" 2>/dev/null; then
        modeline=$(cvt "$1" "$2" 60 | sed -n 's/^Modeline "[^"]*" *//p')
        [ -n "$modeline" ] || return 1
        # shellcheck disable=SC2086  # the modeline is a list of numbers and flags
        xrandr --newmode "deskvm-$want" $modeline 2>/dev/null
        xrandr --addmode "$output" "deskvm-$want" || return 1
        xrandr --output "$output" --mode "deskvm-$want" || return 1
    fi
    [ "$(screen_size)" = "$want" ]
}
