// Command probe attaches to a device's enforcer from inside a container the
// way the shim does (the client socket under $MGPU_RUN_DIR), maps the
// region's control file it is given and prints, one key=value per line,
// what the region says about the instance, then tries, as a hostile tenant
// would, to make the read-only files writable:
//
//	probe [-device X] [-hold DURATION]
//
//	attach=ok slot=S device=X instance=Y
//	region.device=X region.instance=Y region.core=C region.memory_limit=B region.slot_pid=P
//	region.path=<the fd's link> region.path_open="<error opening that path>"
//	tamper.control.mmap=<errno of mmap PROT_WRITE> tamper.control.reopen=<errno of reopening it O_RDWR>
//	tamper.other.mmap=... tamper.other.reopen=...   (another slot's proc file)
//	tamper.own.mmap=ok                              (the own proc file is writable)
//
// or attach=refused / attach=error with the reason (exit status 1). With
// -hold it keeps the attachment for that long (the enforcer counts the
// process) and prints "holding". The e2e tests run it statically linked, so
// the preloaded shim plays no part in it.
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/attach"
	"github.com/mgpu-dev/mgpu/enforcer/region"
)

func main() {
	dev := flag.Int("device", 0, "device index")
	hold := flag.Duration("hold", 0, "keep the attachment this long")
	flag.Parse()
	runDir := os.Getenv("MGPU_RUN_DIR")
	if runDir == "" {
		runDir = "/run/mgpu"
	}
	sock := filepath.Join(runDir, "gpu"+strconv.Itoa(*dev), "client", "client.sock")
	res, err := attach.Dial(sock, 5*time.Second)
	if err != nil {
		if re, ok := err.(*attach.RefusedError); ok { //nolint:errorlint // Dial returns it unwrapped
			fmt.Printf("attach=refused status=%s message=%q\n", re.Status, re.Message)
		} else {
			fmt.Printf("attach=error error=%q\n", err.Error())
		}
		os.Exit(1)
	}
	fmt.Printf("attach=ok slot=%d device=%d instance=%d\n", res.Slot, res.DeviceIndex, res.InstanceID)
	mem, err := unix.Mmap(int(res.Control.Fd()), 0, region.ControlFileSize, unix.PROT_READ, unix.MAP_SHARED) //nolint:gosec // fds fit in int
	if err != nil {
		fmt.Printf("region=error error=%q\n", err.Error())
		os.Exit(1)
	}
	l := (*region.Layout)(unsafe.Pointer(&mem[0])) //nolint:gosec // the region ABI
	slotPID := uint32(0)
	if int(res.Slot) < region.MaxProcs {
		slotPID = l.Slots[res.Slot].PID.Load()
	}
	fmt.Printf("region.magic_ok=%v region.device=%d region.instance=%d region.core=%d region.memory_limit=%d region.slot_pid=%d\n",
		l.Magic == region.Magic, l.DeviceIndex, l.InstanceID, l.Core, l.MemoryLimit, slotPID)
	// The descriptor names the control file on the host; that path must not
	// lead anywhere from inside the container.
	path, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", res.Control.Fd()))
	if err != nil {
		path = "?"
	}
	open := "ok"
	if f, err := os.Open(path); err != nil { //nolint:gosec // probing on purpose
		open = err.Error()
	} else {
		_ = f.Close()
	}
	fmt.Printf("region.path=%s\nregion.path_open=%q\n", path, open)
	fmt.Printf("tamper.control.mmap=%s tamper.control.reopen=%s\n", mapWritable(res.Control), reopenWritable(res.Control))
	if other, stop, err := peer(sock); err != nil {
		fmt.Printf("tamper.other=error error=%q\n", err.Error())
	} else {
		fmt.Printf("tamper.other.mmap=%s tamper.other.reopen=%s\n", mapWritable(other), reopenWritable(other))
		stop()
	}
	fmt.Printf("tamper.own.mmap=%s\n", mapWritable(res.Own))
	if *hold > 0 {
		fmt.Println("holding")
		time.Sleep(*hold) // the attachment is what is held
	}
}

// mapWritable tries a shared writable mapping of f: "ok" or the errno.
func mapWritable(f *os.File) string {
	m, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED) //nolint:gosec // fds fit in int
	if err != nil {
		return errnoName(err)
	}
	_ = unix.Munmap(m)
	return "ok"
}

// reopenWritable tries to open f's /proc/self/fd link for writing.
func reopenWritable(f *os.File) string {
	g, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), os.O_RDWR, 0)
	if err != nil {
		return errnoName(err)
	}
	_ = g.Close()
	return "ok"
}

func errnoName(err error) string {
	var en unix.Errno
	if errors.As(err, &en) && unix.ErrnoName(en) != "" {
		return unix.ErrnoName(en)
	}
	return "error"
}

// peer starts a second attached process of the container (this program
// with -hold) and returns its proc file as the enforcer hands it to this
// one (read-only), and how to stop it.
func peer(sock string) (*os.File, func(), error) {
	cmd := exec.Command("/proc/self/exe", "-hold", "60s")
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	stop := func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }
	sc := bufio.NewScanner(out)
	for sc.Scan() && sc.Text() != "holding" {
	}
	peers, err := attach.Peers(sock, 5*time.Second)
	if err != nil {
		stop()
		return nil, nil, err
	}
	for _, f := range peers {
		return f, stop, nil
	}
	stop()
	return nil, nil, errors.New("no peer")
}
