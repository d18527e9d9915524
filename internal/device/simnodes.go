package device

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/internal/config"
)

// The simulated GPUs' device nodes are character devices with the numbers of
// /dev/null (1:3): opening, reading and writing them is harmless, every
// container runtime's default device cgroup already allows them, and they
// give a container a real node per simulated GPU, as a real GPU would.
const (
	SimNodeMajor = 1
	SimNodeMinor = 3
	simNodeMode  = 0o666
)

// Mknoder creates device nodes; the real one calls mknod(2), tests pass a
// fake.
type Mknoder interface {
	Mknod(path string, mode uint32, dev int) error
}

type sysMknoder struct{}

func (sysMknoder) Mknod(path string, mode uint32, dev int) error { return unix.Mknod(path, mode, dev) }

// SimNodeOption changes how EnsureSimNodes works.
type SimNodeOption func(*simNodeOpts)

type simNodeOpts struct{ mk Mknoder }

// WithMknoder makes EnsureSimNodes create nodes through m.
func WithMknoder(m Mknoder) SimNodeOption { return func(o *simNodeOpts) { o.mk = m } }

// ErrNeedRoot is returned (wrapped) when device nodes cannot be created for
// lack of privilege.
var ErrNeedRoot = errors.New("creating device nodes needs root (CAP_MKNOD outside a user namespace)")

// EnsureSimNodes creates the device nodes of the sim backend's GPUs and its
// control node (SimNodeDir: nvidia0..nvidiaN-1, nvidiactl) as character
// devices 1:3, mode 0666. It is idempotent: nodes that already are such a
// device are kept. A path that exists as anything else is an error (it is
// never removed). It returns the nodes' paths.
func EnsureSimNodes(cfg *config.Config, opts ...SimNodeOption) ([]string, error) {
	o := simNodeOpts{mk: sysMknoder{}}
	for _, opt := range opts {
		opt(&o)
	}
	s := NewSim(cfg)
	var paths []string
	for _, d := range s.devs {
		paths = append(paths, d.Nodes...)
	}
	paths = append(paths, s.ControlNodes()...)
	if err := os.MkdirAll(s.nodeDir, 0o755); err != nil { //nolint:gosec // device nodes must be reachable by containers' users
		return nil, fmt.Errorf("create simulated device node directory: %w", err)
	}
	for _, p := range paths {
		if err := ensureSimNode(o.mk, p); err != nil {
			return nil, err
		}
	}
	return paths, nil
}

func ensureSimNode(mk Mknoder, path string) error {
	want := unix.Mkdev(SimNodeMajor, SimNodeMinor)
	var st unix.Stat_t
	err := unix.Lstat(path, &st)
	if err == nil {
		if st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == want {
			return nil
		}
		return fmt.Errorf("simulated device node %s exists but is not the character device %d:%d; remove it", path, SimNodeMajor, SimNodeMinor)
	}
	if !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("simulated device node %s: %w", path, err)
	}
	// Create under a temporary name and rename, so a concurrent reader never
	// sees a half-made node and two concurrent runs do not fail each other.
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+fmt.Sprintf(".tmp%d", os.Getpid()))
	_ = os.Remove(tmp)
	if err := mk.Mknod(tmp, unix.S_IFCHR|simNodeMode, int(want)); err != nil { //nolint:gosec // Mkdev(1,3) fits an int
		if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) {
			return fmt.Errorf("create simulated device node %s: %w", path, ErrNeedRoot)
		}
		return fmt.Errorf("create simulated device node %s: %w", path, err)
	}
	// mknod applies the umask; set the mode the node must have.
	if err := os.Chmod(tmp, simNodeMode); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("create simulated device node %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("create simulated device node %s: %w", path, err)
	}
	return nil
}
