// Package deviceplugin is mgpu's kubelet device plugin for the resource
// vke.volcengine.com/mgpu-core: 100 device IDs per GPU, one per percent of
// its time, healthy while the GPU's enforcer answers. It registers with the
// kubelet (and again whenever the kubelet restarts), lists the IDs, prefers
// allocations by placement policy (binpack or spread, package placement)
// and answers Allocate with the GPU's CDI device and MGPU_CORE.
//
// vke.volcengine.com/mgpu-memory is node capacity, not device IDs, and
// reaches the container another way. ACK's aliyun.com/gpu-mem is device
// IDs, one per GiB, served by the memory plugin (WithMemory, memplugin.go)
// in every ACK mode that has it.
// docs/kubernetes.md describes the plugin as the kubelet sees it.
package deviceplugin

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/kube/placement"
)

// Names the kubelet knows the plugin by.
const (
	// ResourceName is the extended resource the plugin serves.
	ResourceName = "vke.volcengine.com/mgpu-core"
	// SocketName is the plugin's socket in the device-plugin directory
	// (the Endpoint of its registration).
	SocketName = "mgpu-core.sock"
	// KubeletSocketName is the kubelet's registration socket there.
	KubeletSocketName = "kubelet.sock"
	// DefaultDir is the kubelet's device-plugin directory.
	DefaultDir = pluginapi.DevicePluginPath
)

// Defaults of the options.
const (
	DefaultPollInterval = 5 * time.Second
	// cardsTimeout bounds one poll of the card source.
	cardsTimeout = 5 * time.Second
)

// Plugin is the device plugin of one node. Create it with New, run it
// with Run.
type Plugin struct {
	pluginapi.UnimplementedDevicePluginServer

	gpus     []int // the node's GPU indexes, sorted
	scheme   Scheme
	src      CardSource
	dir      string
	policy   atomic.Int32 // placement.Policy; the node label may change it
	resolver *Resolver    // nil: preferred allocations know no memory
	uuids    map[int]string
	cdiKind  string
	interval time.Duration
	log      *slog.Logger
	dist     func(a, b int) int // link rank of two GPUs (topology mode); nil: all alike

	// The memory plugin (WithMemory): GiB of each GPU; nil for a plugin
	// of a Core resource.
	memGiB map[int]int
	// nodeScheme is the node's scheme, as SetMode last told it; the
	// memory plugin's answers depend on it.
	nodeScheme atomic.Pointer[Scheme]
	// A bare GPU (share, mps): its device nodes by GPU and the control
	// nodes every GPU container needs, host paths.
	bareNodes   map[int][]string
	bareControl []string
	mpsPipe     string // the MPS control daemon's pipe directory

	mu      sync.Mutex
	active  bool          // the node's mode is the scheme's: devices are listed
	healthy map[int]bool  // by GPU index; absent: not polled yet (healthy)
	changed chan struct{} // closed and replaced when active or healthy changes
	repoll  chan struct{} // (1) activated: poll the GPUs' health now
}

// Option configures a Plugin.
type Option func(*Plugin)

// WithScheme sets the resource the plugin serves (default SchemeMGPU).
func WithScheme(s Scheme) Option { return func(p *Plugin) { p.scheme = s } }

// WithTopology gives the rank of the link between two GPUs (0 the same
// GPU, larger farther; device.Link.Rank), which a topology scheme's
// preferred allocations minimise. Without it every pair is alike.
func WithTopology(dist func(a, b int) int) Option { return func(p *Plugin) { p.dist = dist } }

// WithActive sets whether the plugin starts active (default true): an
// inactive plugin lists no devices and allocates none.
func WithActive(active bool) Option { return func(p *Plugin) { p.active = active } }

// WithMode starts the plugin as SetMode(s) would set it.
func WithMode(s Scheme) Option {
	return func(p *Plugin) { p.nodeScheme.Store(&s); p.active = p.Serves(s) }
}

// WithMemory makes the plugin the memory plugin: it serves ACKMemory, one
// device ID per GiB of each GPU (memory in MiB by index, rounded down to
// whole GiB), and answers as the node's scheme (SetMode) says. Give it
// before WithMode.
func WithMemory(gpuMiB map[int]uint64) Option {
	return func(p *Plugin) {
		p.scheme = ACKMemory
		p.memGiB = map[int]int{}
		for g, m := range gpuMiB {
			p.memGiB[g] = int(m / ACKMemory.MemoryUnitMiB)
		}
	}
}

// WithBareDevices names the device nodes (host paths) of each GPU and the
// control nodes, which the memory plugin gives a container of a bare
// scheme (share, mps) instead of mgpu's CDI device.
func WithBareDevices(nodes map[int][]string, control []string) Option {
	return func(p *Plugin) { p.bareNodes, p.bareControl = maps.Clone(nodes), slices.Clone(control) }
}

// WithMPSPipe sets the pipe directory of the MPS control daemon, which
// mps containers get mounted (default DefaultMPSPipe).
func WithMPSPipe(dir string) Option { return func(p *Plugin) { p.mpsPipe = dir } }

// Serves reports whether the plugin lists its devices when the node's
// scheme is s: s's Core is the plugin's resource, or (the memory plugin)
// s's Memory is, as device IDs.
func (p *Plugin) Serves(s Scheme) bool {
	if p.memGiB != nil {
		return s.MemoryIDs && s.Memory == p.scheme.Core
	}
	return s.Core != "" && s.Core == p.scheme.Core
}

// SetMode tells the plugin the node's scheme: it is active when it serves
// it (Serves), and the memory plugin answers as s says.
func (p *Plugin) SetMode(s Scheme) {
	p.nodeScheme.Store(&s)
	p.SetActive(p.Serves(s))
}

// NodeScheme is the node's scheme as SetMode last told it; before that,
// the plugin's own.
func (p *Plugin) NodeScheme() Scheme {
	if s := p.nodeScheme.Load(); s != nil {
		return *s
	}
	return p.scheme
}

// SetActive makes the plugin list its devices (true) or none (false); the
// kubelet hears of it at once through ListAndWatch. The node's mode
// changed.
func (p *Plugin) SetActive(active bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.active != active {
		p.active = active
		close(p.changed)
		p.changed = make(chan struct{})
		if active {
			select { // health was not polled while inactive
			case p.repoll <- struct{}{}:
			default:
			}
		}
	}
}

// Active reports whether the plugin lists its devices.
func (p *Plugin) Active() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.active
}

// Scheme is the scheme whose Core resource the plugin serves (ACKMemory
// for the memory plugin).
func (p *Plugin) Scheme() Scheme { return p.scheme }

// WithDir sets the device-plugin directory (default DefaultDir).
func WithDir(dir string) Option { return func(p *Plugin) { p.dir = dir } }

// WithPolicy sets the placement policy of preferred allocations (default
// placement.Binpack).
func WithPolicy(pol placement.Policy) Option { return func(p *Plugin) { p.SetPolicy(pol) } }

// WithUUIDs names the GPUs' UUIDs (by index), which Allocate passes as
// CUDA_VISIBLE_DEVICES.
func WithUUIDs(uuids map[int]string) Option { return func(p *Plugin) { p.uuids = maps.Clone(uuids) } }

// WithResolver lets preferred allocations of shares plan for the memory of
// the container being admitted and for what the kubelet's allocations
// already hold (Resolver.pendingMemory).
func WithResolver(r *Resolver) Option { return func(p *Plugin) { p.resolver = r } }

// SetPolicy changes the placement policy of later preferred allocations
// (the node's ack.node.gpu.placement label changed).
func (p *Plugin) SetPolicy(pol placement.Policy) { p.policy.Store(int32(pol)) }

// Policy is the placement policy of preferred allocations.
func (p *Plugin) Policy() placement.Policy { return placement.Policy(p.policy.Load()) }

// WithCDIKind sets the CDI kind of the devices Allocate names (default
// config.DefaultCDIKind; the node config's cdi_kind).
func WithCDIKind(kind string) Option { return func(p *Plugin) { p.cdiKind = kind } }

// WithPollInterval sets how often the card source is asked for health
// (default DefaultPollInterval).
func WithPollInterval(d time.Duration) Option { return func(p *Plugin) { p.interval = d } }

// WithLogger sets the logger (default slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(p *Plugin) { p.log = l } }

// New returns the plugin of a node whose GPUs have the given indexes; src
// tells which of them are healthy.
func New(gpus []int, src CardSource, opts ...Option) (*Plugin, error) {
	p := &Plugin{
		gpus:     slices.Clone(gpus),
		scheme:   SchemeMGPU,
		active:   true,
		src:      src,
		dir:      DefaultDir,
		cdiKind:  config.DefaultCDIKind,
		interval: DefaultPollInterval,
		log:      slog.Default(),
		healthy:  map[int]bool{},
		changed:  make(chan struct{}),
		repoll:   make(chan struct{}, 1),
		mpsPipe:  DefaultMPSPipe,
	}
	for _, o := range opts {
		o(p)
	}
	slices.Sort(p.gpus)
	if len(p.gpus) != len(slices.Compact(slices.Clone(p.gpus))) {
		return nil, fmt.Errorf("GPU indexes %v: each GPU once", gpus)
	}
	for _, g := range p.gpus {
		if g < 0 {
			return nil, fmt.Errorf("GPU index %d: must be >= 0", g)
		}
	}
	if p.interval <= 0 {
		return nil, fmt.Errorf("poll interval %v: must be positive", p.interval)
	}
	return p, nil
}

// SocketPath is the plugin's socket.
func (p *Plugin) SocketPath() string { return filepath.Join(p.dir, p.scheme.Socket) }

// KubeletSocketPath is the kubelet's registration socket.
func (p *Plugin) KubeletSocketPath() string { return filepath.Join(p.dir, KubeletSocketName) }

// hasGPU reports whether the node has GPU index.
func (p *Plugin) hasGPU(index int) bool {
	_, ok := slices.BinarySearch(p.gpus, index)
	return ok
}

// options are the plugin's DevicePluginOptions, told at registration and
// by GetDevicePluginOptions.
func options() *pluginapi.DevicePluginOptions {
	return &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true}
}

// GetDevicePluginOptions implements DevicePluginServer.
func (p *Plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return options(), nil
}

// PreStartContainer implements DevicePluginServer; the plugin does not ask
// for it (PreStartRequired is false).
func (p *Plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}
