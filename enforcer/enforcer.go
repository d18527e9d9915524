// Package enforcer is the per-device daemon of mgpu (mgpu-enforcer): it
// keeps the device's instance table (admission, persistence, restore after
// a restart), serves the control API on control.sock and the attach
// protocol on client/client.sock, watches attached processes and reaps them,
// and runs the arbitration loop that writes grants into the instances'
// regions. docs/enforcer.md describes it; docs/control-api.md the API.
//
// Other Go code (tests, the demo) can run an enforcer in-process:
//
//	e, err := enforcer.New(cfg, 0, enforcer.WithLogger(log))
//	...
//	go e.Run(ctx) // sockets accept connections as soon as New returns
//
// Cancelling ctx shuts it down; instances and regions stay for the next
// start.
package enforcer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/arbiter"
	"github.com/mgpu-dev/mgpu/enforcer/backstop"
	"github.com/mgpu-dev/mgpu/enforcer/procfs"
	"github.com/mgpu-dev/mgpu/enforcer/region"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
)

// Defaults of the options.
const (
	DefaultActiveTick    = arbiter.DefaultTick    // shortest interval while anything has demand or a grant
	DefaultMaxActiveTick = 20 * time.Millisecond  // longest interval then (what the arbiter cannot foresee and no process reports is noticed within it)
	DefaultIdleTick      = 5 * time.Millisecond   // processes attached, none active
	DefaultDormantTick   = 250 * time.Millisecond // no process attached
	DefaultAttachTimeout = 500 * time.Millisecond // a request must arrive, and its reply leave, within it (a silent client holds one of its instance's attachActivePerKey that long)
	DefaultSweep         = time.Second
)

type options struct {
	log           *slog.Logger
	dev           *device.Info
	proc          procfs.FS
	activeTick    time.Duration
	maxActiveTick time.Duration
	idleTick      time.Duration
	dormantTick   time.Duration
	attachTimeout time.Duration
	sweep         time.Duration
	nvml          nvml.Interface
}

// Option configures New.
type Option func(*options)

// WithLogger sets the logger (default: discard).
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.log = l } }

// WithDevice describes the device instead of asking the configured backend.
func WithDevice(d device.Info) Option { return func(o *options) { o.dev = &d } }

// WithNVML makes the driver backstop use lib (tests: go-nvml's mock)
// instead of loading libnvidia-ml.so.1.
func WithNVML(lib nvml.Interface) Option { return func(o *options) { o.nvml = lib } }

// WithTicks sets the arbitration tick while active (a fixed interval: the
// loop then ticks every active whatever the arbiter's next decision), while
// idle with processes attached, and with no process attached.
func WithTicks(active, idle, dormant time.Duration) Option {
	return func(o *options) {
		o.activeTick, o.maxActiveTick, o.idleTick, o.dormantTick = active, active, idle, dormant
	}
}

// WithActiveTicks bounds the interval between two ticks while active: the
// loop ticks at the arbiter's next decision point, but no sooner than lo and
// no later than hi after the previous tick.
func WithActiveTicks(lo, hi time.Duration) Option {
	return func(o *options) { o.activeTick, o.maxActiveTick = lo, max(lo, hi) }
}

// WithAttachTimeout bounds how long an attach connection may take.
func WithAttachTimeout(d time.Duration) Option { return func(o *options) { o.attachTimeout = d } }

// Enforcer serves one device.
type Enforcer struct {
	o       options
	cfg     *config.Config
	index   int
	dev     device.Info
	runDir  string
	regions string
	view    *region.View // read-only view of regions: what processes get
	// attachLim is the attach server's budgets (set before it serves).
	attachLim *attachLimiter
	nvml      nvml.Interface
	backstop  *backstop.Watcher // nil: off
	statePth  string
	lock      *os.File
	bootID    string
	bootTime  time.Time // zero when unknown
	selfNS    uint64
	selfCgs   []string
	started   time.Time
	// releasedGPU is the measured GPU time of the instances released since
	// the enforcer started (the device's busy total keeps it).
	releasedGPU uint64

	mu         sync.Mutex
	settings   config.DeviceSettings // what the device runs
	configured config.DeviceSettings // what the config says (pending while it differs)
	epoch      uint32
	byID       map[int]*instance
	list       []*instance // by id
	byCID      map[string]*instance
	gen        uint64 // bumped when an instance comes or goes
	attrs      map[int]attribution
	watches    map[int]watchRef // pidfd -> what it watches
	arb        *arbiter.Arbiter
	usage      map[int]arbiter.Usage
	saveSeq    uint64
	epfd       int  // the loop's epoll set of wake sockets (wake.go); -1: none
	woken      bool // the loop's current tick was woken by a process (the loop's only)
	closed     bool
	restored   bool // the table was restored; only then is it written back

	saveMu  sync.Mutex
	savedAt uint64

	// blank is a region made ahead of time (regions/.blank) that the next
	// create renames into place; blanking is set while one is being made.
	blank    *region.Region
	blanking bool
	bg       sync.WaitGroup

	w       *watcher
	control *net.UnixListener
	client  *net.UnixListener
	http    *http.Server
	kick    chan struct{}

	closeOnce sync.Once
}

// New prepares the enforcer of device index: it takes the device's lock,
// restores the instance table from the state directory, re-adopts the
// regions and the attached processes, and listens on the control and client
// sockets. Run serves them.
func New(cfg *config.Config, index int, opts ...Option) (*Enforcer, error) {
	o := options{
		log:           slog.New(slog.NewTextHandler(io.Discard, nil)),
		proc:          procfs.Host,
		activeTick:    DefaultActiveTick,
		maxActiveTick: DefaultMaxActiveTick,
		idleTick:      DefaultIdleTick,
		dormantTick:   DefaultDormantTick,
		attachTimeout: DefaultAttachTimeout,
		sweep:         DefaultSweep,
	}
	for _, f := range opts {
		f(&o)
	}
	e := &Enforcer{
		o: o, cfg: cfg, index: index,
		runDir:   cfg.DeviceRunDir(index),
		statePth: filepath.Join(cfg.DeviceStateDir(index), StateFileName),
		byID:     map[int]*instance{},
		byCID:    map[string]*instance{},
		epfd:     newEpoll(),
		attrs:    map[int]attribution{},
		watches:  map[int]watchRef{},
		usage:    map[int]arbiter.Usage{},
		kick:     make(chan struct{}, 1),
		started:  time.Now(),
	}
	e.regions = filepath.Join(e.runDir, api.RegionsDirName)
	if err := e.setup(); err != nil {
		e.Close()
		return nil, err
	}
	return e, nil
}

func (e *Enforcer) setup() error {
	if e.o.dev != nil {
		e.dev = *e.o.dev
	} else {
		b, err := device.Open(e.cfg)
		if err != nil {
			return err
		}
		devs, err := b.Devices()
		_ = b.Close()
		if err != nil {
			return err
		}
		if e.dev, err = device.Find(devs, e.index); err != nil {
			return err
		}
	}
	if err := e.makeDirs(); err != nil {
		return err
	}
	if err := e.takeLock(); err != nil {
		return err
	}
	var err error
	if e.view, err = region.NewView(e.regions); err != nil {
		return err
	}
	if e.selfNS, err = e.o.proc.PidNS(os.Getpid()); err != nil {
		return fmt.Errorf("read own pid namespace: %w", err)
	}
	if e.selfCgs, err = e.o.proc.Cgroups(os.Getpid()); err != nil {
		return fmt.Errorf("read own cgroup: %w", err)
	}
	e.bootID = readBootID()
	e.bootTime = readBootTime()
	if e.w, err = newWatcher(); err != nil {
		return err
	}
	if err := e.restore(); err != nil {
		return err
	}
	if err := e.openBackstop(); err != nil {
		return err
	}
	return e.listen()
}

func (e *Enforcer) makeDirs() error {
	for _, d := range []struct {
		path string
		mode os.FileMode
	}{
		{e.runDir, 0o755},
		{e.regions, 0o700},
		{filepath.Join(e.runDir, api.ClientDirName), 0o755},
		{filepath.Dir(e.statePth), 0o700},
	} {
		if err := os.MkdirAll(d.path, d.mode); err != nil {
			return fmt.Errorf("create %s: %w", d.path, err)
		}
		if err := os.Chmod(d.path, d.mode); err != nil {
			return fmt.Errorf("chmod %s: %w", d.path, err)
		}
	}
	return nil
}

// ErrRunning is returned (wrapped) by New when another enforcer serves the
// device.
var ErrRunning = errors.New("the device already has an enforcer")

func (e *Enforcer) takeLock() error {
	path := filepath.Join(e.runDir, api.LockFileName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600) //nolint:gosec // the enforcer's own run directory
	if err != nil {
		return fmt.Errorf("open lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil { //nolint:gosec // fds fit in int
		b, _ := io.ReadAll(io.LimitReader(f, 32))
		_ = f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return fmt.Errorf("%w: device %d is served by pid %s (lock %s)", ErrRunning, e.index, strings.TrimSpace(string(b)), path)
		}
		return fmt.Errorf("lock %s: %w", path, err)
	}
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	e.lock = f
	return nil
}

func (e *Enforcer) listen() error {
	ctl, err := listenUnix(api.ControlSocket(e.runDir), 0o600)
	if err != nil {
		return err
	}
	e.control = ctl
	cl, err := listenUnix(api.ClientSocket(e.runDir), 0o666)
	if err != nil {
		return err
	}
	e.client = cl
	e.http = &http.Server{
		Handler:           e.handler(),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      10 * time.Second,
		IdleTimeout:       60 * time.Second,
		MaxHeaderBytes:    16 << 10,
		ErrorLog:          slog.NewLogLogger(e.o.log.Handler(), slog.LevelWarn),
	}
	return nil
}

// listenUnix replaces a stale socket (the device lock is held) and sets the
// socket's mode. The socket is created with the process umask (at most
// 0755: nobody but root can connect) before chmod widens or narrows it.
func listenUnix(path string, mode os.FileMode) (*net.UnixListener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("remove stale socket: %w", err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	ln.SetUnlinkOnClose(true)
	if err := os.Chmod(path, mode); err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("chmod %s: %w", path, err)
	}
	return ln, nil
}

// ControlSocket returns the path of the control socket.
func (e *Enforcer) ControlSocket() string { return api.ControlSocket(e.runDir) }

// ClientSocket returns the path of the client (attach) socket.
func (e *Enforcer) ClientSocket() string { return api.ClientSocket(e.runDir) }

// Run serves until ctx is cancelled, then shuts down: it stops accepting,
// withdraws every grant (work waits for the next enforcer), writes the state
// and releases the device's lock. Instances and regions stay.
func (e *Enforcer) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errc := make(chan error, 2)
	wg.Add(5)
	go func() {
		defer wg.Done()
		if err := e.http.Serve(e.control); err != nil && !errors.Is(err, http.ErrServerClosed) {
			errc <- fmt.Errorf("control socket: %w", err)
			cancel()
		}
	}()
	go func() { defer wg.Done(); e.serveAttach(ctx) }()
	go func() { defer wg.Done(); e.watch(ctx) }()
	go func() { defer wg.Done(); e.loop(ctx) }()
	go func() { defer wg.Done(); e.runBackstop(ctx) }()
	e.mu.Lock()
	pol, n := e.settings.ComputePolicy, len(e.list)
	e.refillBlankLocked()
	e.mu.Unlock()
	e.o.log.Info("serving", "policy", pol.String(), "instances", n, "epoch", e.epoch,
		"control", e.ControlSocket(), "client", e.ClientSocket())
	<-ctx.Done()
	sctx, scancel := context.WithTimeout(context.Background(), 2*time.Second)
	_ = e.http.Shutdown(sctx)
	scancel()
	_ = e.client.Close()
	e.w.stop()
	wg.Wait()
	e.Close()
	select {
	case err := <-errc:
		return err
	default:
		return nil
	}
}

// Close releases what New took without serving (Run calls it). It is
// idempotent.
func (e *Enforcer) Close() {
	e.closeOnce.Do(func() {
		if e.control != nil {
			_ = e.control.Close()
		}
		if e.client != nil {
			_ = e.client.Close()
		}
		e.mu.Lock()
		e.closed = true
		e.guard(func() {
			for _, in := range e.list {
				in.reg.SetGrant(0)
				in.reg.L().Wake.Store(0) // nobody is left to wake
			}
		})
		e.mu.Unlock()
		if e.restored {
			if err := e.save(); err != nil {
				e.o.log.Error("write state", "err", err)
			}
		}
		e.bg.Wait()
		e.mu.Lock()
		for _, in := range e.list {
			in.closeFDs()
			e.closeWakeLocked(in)
			_ = in.reg.Close()
		}
		if e.epfd >= 0 {
			_ = unix.Close(e.epfd)
			e.epfd = -1
		}
		e.dropBlankLocked()
		e.mu.Unlock()
		if e.w != nil {
			e.w.close()
		}
		_ = e.view.Close()
		if e.nvml != nil {
			_ = e.nvml.Shutdown()
		}
		if e.lock != nil {
			_ = e.lock.Close()
		}
	})
}

func readBootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// readBootTime returns when the machine booted (btime of /proc/stat), or
// the zero time.
func readBootTime() time.Time {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return time.Time{}
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "btime "); ok {
			if sec, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil && sec > 0 {
				return time.Unix(sec, 0)
			}
		}
	}
	return time.Time{}
}

// kickLoop wakes the arbitration loop.
func (e *Enforcer) kickLoop() {
	select {
	case e.kick <- struct{}{}:
	default:
	}
}
