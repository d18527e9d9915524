package region

import (
	"errors"
	"fmt"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// View is a read-only view of a directory of regions: a detached clone of
// its mount (open_tree), made read-only (mount_setattr), through which
// processes get control files. A descriptor opened through it cannot
// become writable: mmap(PROT_WRITE) and mprotect
// fail with EACCES, and reopening /proc/self/fd/N for writing fails with
// EROFS, whatever the process's privileges on the file. The clone is
// attached nowhere, so it needs no clean-up and no process can see it in a
// mount table; it lives as long as a descriptor of it does.
type View struct {
	fd  int
	dir string
}

// NewView makes the read-only view of dir. It needs CAP_SYS_ADMIN and
// Linux >= 5.12.
func NewView(dir string) (*View, error) {
	fd, err := unix.OpenTree(unix.AT_FDCWD, dir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("read-only view of %s: open_tree: %w (the enforcer needs CAP_SYS_ADMIN and Linux >= 5.12)", dir, err)
	}
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("read-only view of %s: mount_setattr: %w", dir, err)
	}
	return &View{fd: fd, dir: dir}, nil
}

// Close drops the view (descriptors opened through it stay valid).
func (v *View) Close() error {
	if v == nil || v.fd < 0 {
		return nil
	}
	err := unix.Close(v.fd)
	v.fd = -1
	return err
}

// openRO opens name (relative to the viewed directory) read-only through
// the view.
func (v *View) openRO(name string) (int, error) {
	return unix.Openat(v.fd, name, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NOCTTY, 0)
}

// ErrNotInView is returned by TenantFDs for a region outside the view.
var ErrNotInView = errors.New("region is not in the read-only view's directory")

// TenantFDs returns the descriptors an attaching process in slot receives,
// in the order of mgpu_region.h's attach protocol: the control file
// read-only, then its own slot's memfd read-write (made now if the slot
// has none: Prepare). The caller closes them.
func (r *Region) TenantFDs(v *View, slot int) ([]int, error) {
	name, err := r.nameIn(v)
	if err != nil {
		return nil, err
	}
	if slot < 0 || slot >= MaxProcs {
		return nil, fmt.Errorf("slot %d out of range", slot)
	}
	if err := r.Prepare(slot); err != nil {
		return nil, err
	}
	ctl, err := v.openRO(name + "/" + ControlName)
	if err != nil {
		return nil, fmt.Errorf("open control read-only: %w", err)
	}
	own, err := r.reopen(slot, unix.O_RDWR)
	if err != nil {
		_ = unix.Close(ctl)
		return nil, fmt.Errorf("open own slot: %w", err)
	}
	return []int{ctl, own}, nil
}

// PeerFDs returns read-only descriptors of the given slots' memfds, in that
// order (slots in use: each has its memfd). The caller closes them.
//
// They are duplicates of one read-only description per slot, opened the
// first time a peer asks and kept while the slot keeps its memfd: the
// processes of an instance asking for their peers share it (a path lookup
// through /proc per slot and request cost most of what 64 processes
// starting at once cost the enforcer). What a process does to that
// description (flags, locks) reaches only processes of its own instance,
// never the enforcer's description, and no process can take a lease on it
// while the enforcer holds its own open for writing (reopen).
func (r *Region) PeerFDs(v *View, slots []int) ([]int, error) {
	if _, err := r.nameIn(v); err != nil {
		return nil, err
	}
	fds := make([]int, 0, len(slots))
	for _, i := range slots {
		fd, err := r.peerFD(i)
		if err != nil {
			for _, fd := range fds {
				_ = unix.Close(fd)
			}
			return nil, fmt.Errorf("open slot %d read-only: %w", i, err)
		}
		fds = append(fds, fd)
	}
	return fds, nil
}

// peerFD returns a duplicate of slot i's read-only description, opening it
// if the slot has none yet.
func (r *Region) peerFD(i int) (int, error) {
	if i < 0 || i >= MaxProcs || r.fds[i] < 0 {
		return -1, fmt.Errorf("slot %d has no memfd", i)
	}
	if r.ro[i] < 0 {
		fd, err := r.reopen(i, unix.O_RDONLY)
		if err != nil {
			return -1, err
		}
		r.ro[i] = fd
	}
	return unix.FcntlInt(uintptr(r.ro[i]), unix.F_DUPFD_CLOEXEC, 0) //nolint:gosec // a valid fd
}

// reopen opens slot i's memfd anew (through /proc/self/fd) with mode
// O_RDWR or O_RDONLY. A process gets a file description of its own, never
// a duplicate of the enforcer's: what it does to its description (flags,
// locks, leases) cannot reach the enforcer's, and while the enforcer holds
// its own open for writing no process can take a lease that would make the
// enforcer's next open of the memfd wait.
func (r *Region) reopen(i, mode int) (int, error) {
	if i < 0 || i >= MaxProcs || r.fds[i] < 0 {
		return -1, fmt.Errorf("slot %d has no memfd", i)
	}
	return unix.Open("/proc/self/fd/"+strconv.Itoa(r.fds[i]), mode|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
}

func (r *Region) nameIn(v *View) (string, error) {
	if filepath.Dir(r.dir) != filepath.Clean(v.dir) {
		return "", fmt.Errorf("%w: %s", ErrNotInView, r.dir)
	}
	return filepath.Base(r.dir), nil
}
