package procfs

import "golang.org/x/sys/unix"

// PidfdExited reports whether the process of pidfd has exited (a pidfd
// polls readable then), or pidfd is unusable. A poll interrupted by a
// signal is asked again: Go preempts its threads with signals, and poll(2)
// is never restarted after a handler, so an interrupted poll says nothing
// about the process.
func PidfdExited(pidfd int) bool {
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}} //nolint:gosec // fds fit in int32
	for {
		n, err := unix.Poll(fds, 0)
		if err == unix.EINTR {
			continue
		}
		return err != nil || n > 0
	}
}
