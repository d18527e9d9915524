package region

import (
	"bufio"
	"bytes"
	"os"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/procfs"
)

// Holder is a live process that may hold memfds of a region: an attached
// process maps its own slot's and those of the peers it asked for, and may
// keep descriptors of them.
type Holder struct {
	PID int
	// PidFD is a pidfd of PID. What Recover read of PID counts only if the
	// process has not exited by the end of the reading, so it was not
	// another process that reused the pid.
	PidFD int
}

// Recover finds the memfd of every slot that has none here, and whose
// identity the control file records, among what the holders hold: their
// mappings (/proc/<pid>/map_files, which needs CAP_SYS_ADMIN or
// CAP_CHECKPOINT_RESTORE) and their descriptors (/proc/<pid>/fd). What it
// opens must be that memfd (device and inode), sealed and of its size as
// newMemfd makes it; it is then mapped as at creation. Nothing it does
// touches the memory. Recover returns the slots found, in order; the
// others stay without memory (until Prepare).
func (r *Region) Recover(holders []Holder) []int {
	want := map[uint64]int{} // inode -> slot
	for i := range MaxProcs {
		if ino := r.l.Slots[i].ProcIno.Load(); r.fds[i] < 0 && ino != 0 {
			want[ino] = i
		}
	}
	var found []int
	for _, h := range holders {
		if len(want) == 0 {
			break
		}
		got := r.recoverFrom(h.PID, want)
		if !procfs.PidfdExited(h.PidFD) {
			found = append(found, got...)
			continue
		}
		for _, i := range got {
			_ = r.dropProc(i)
			want[r.l.Slots[i].ProcIno.Load()] = i
		}
	}
	slices.Sort(found)
	return found
}

// recoverFrom maps the memfds of the slots in want that pid holds, and
// takes them out of want.
func (r *Region) recoverFrom(pid int, want map[uint64]int) []int {
	var got []int
	dir := "/proc/" + strconv.Itoa(pid)
	try := func(path string, ino uint64) {
		i, ok := want[ino]
		if !ok {
			return
		}
		if err := r.adopt(i, path); err == nil {
			delete(want, ino)
			got = append(got, i)
		}
	}
	// The shim closes its descriptors once it has mapped them: the
	// mappings first.
	if maps, err := os.ReadFile(dir + "/maps"); err == nil {
		sc := bufio.NewScanner(bytes.NewReader(maps))
		for sc.Scan() {
			// start-end perms offset dev inode /memfd:mgpu-proc.NNN (deleted)
			f := strings.Fields(sc.Text())
			if len(f) < 6 || !strings.HasPrefix(f[5], "/memfd:"+procPrefix) {
				continue
			}
			if ino, err := strconv.ParseUint(f[4], 10, 64); err == nil {
				try(dir+"/map_files/"+f[0], ino)
			}
		}
	}
	ents, err := os.ReadDir(dir + "/fd")
	if err != nil {
		return got
	}
	for _, ent := range ents {
		path := dir + "/fd/" + ent.Name()
		if len(want) == 0 {
			break
		}
		if link, err := os.Readlink(path); err != nil || !strings.HasPrefix(link, "/memfd:"+procPrefix) {
			continue
		}
		var st unix.Stat_t
		if unix.Stat(path, &st) == nil {
			try(path, st.Ino)
		}
	}
	return got
}

// adopt opens path (a holder's mapping or descriptor of slot i's memfd),
// checks it is the memfd the control file records for slot i, and maps it.
func (r *Region) adopt(i int, path string) error {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return err
	}
	st, err := checkMemfd(fd)
	if err == nil {
		s := &r.l.Slots[i]
		if st.Dev != s.ProcDev.Load() || st.Ino != s.ProcIno.Load() {
			err = ErrInvalid
		}
	}
	if err == nil {
		err = r.mapProc(i, fd)
	}
	if err != nil {
		_ = unix.Close(fd)
	}
	return err
}
