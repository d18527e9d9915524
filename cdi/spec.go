// Package cdi produces mgpu's Container Device Interface spec (kind
// mgpu.io/gpu: devices 0..N-1, GPU-<uuid> and all), validates it with the CDI
// library, writes it, and reads back what the CDI library resolves from the
// spec directories.
package cdi

import (
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	specs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/mgpu-dev/mgpu/cdi/cdienv"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
)

// AllDevices is the name of the device that stands for every GPU.
const AllDevices = "all"

// Environment variables the spec sets in containers (and the hook reads from
// the container's config.json): package cdienv.
const (
	EnvRunDir       = cdienv.RunDir
	EnvDevicePrefix = cdienv.DevicePrefix
)

// Hook settings.
const (
	HookBinary = "mgpu-hook"
	// HookTimeout bounds each hook run, in seconds. The engine kills a hook
	// that runs longer and fails the container start (createRuntime).
	HookTimeout = 10
)

// NVIDIA's character-device major: /dev/nvidiaN is 195:N and /dev/nvidiactl
// is 195:255 (Linux Documentation/admin-guide/devices.txt). Other NVIDIA
// nodes (nvidia-uvm, nvidia-modeset) have dynamic majors that the engine
// reads from the host node.
const (
	nvidiaMajor    = 195
	nvidiactlMinor = 255
)

// ShimPath is the shim library on the host, mounted at the same path.
func ShimPath(cfg *config.Config) string {
	return filepath.Join(cfg.Prefix, "lib", "mgpu", "libmgpu-shim.so")
}

// PreloadPath is the file, mounted at /etc/ld.so.preload in containers, that
// makes the dynamic loader preload the shim. It holds ShimPath and a newline.
func PreloadPath(cfg *config.Config) string {
	return filepath.Join(cfg.Prefix, "lib", "mgpu", "ld.so.preload")
}

// PreloadContent is what PreloadPath must hold.
func PreloadContent(cfg *config.Config) []byte { return []byte(ShimPath(cfg) + "\n") }

// HookPath is the OCI hook binary.
func HookPath(cfg *config.Config) string { return filepath.Join(cfg.Prefix, "bin", HookBinary) }

// ClientDir is the directory of device index's client socket
// (cdienv.ClientDir).
func ClientDir(cfg *config.Config, index int) string { return cdienv.ClientDir(cfg, index) }

// DeviceEnvKey is the per-device environment key of GPU index.
func DeviceEnvKey(index int) string { return cdienv.DeviceKey(index) }

// ErrNoGPUs is returned (wrapped) by Generate for a node without GPUs.
var ErrNoGPUs = errors.New("no GPUs found")

// Option changes what Generate produces.
type Option func(*options)

type options struct {
	hooks      bool
	configPath string
}

// WithoutHooks leaves the createRuntime and poststop hooks out of the spec,
// for testing engines on a node where mgpu-hook is not installed. Containers
// then get the devices and the shim but no instance: the shim fails closed.
func WithoutHooks() Option { return func(o *options) { o.hooks = false } }

// WithConfigPath tells the hooks which node configuration to read (as
// MGPU_CONFIG) when it is not config.DefaultPath.
func WithConfigPath(path string) Option { return func(o *options) { o.configPath = path } }

// Generate builds the spec for devs (the node's GPUs) and controlNodes (the
// device nodes every GPU container needs) under cfg. The spec's cdiVersion
// is the minimum its contents need.
func Generate(cfg *config.Config, devs []device.Info, controlNodes []string, opts ...Option) (*specs.Spec, error) {
	o := options{hooks: true}
	for _, opt := range opts {
		opt(&o)
	}
	if len(devs) == 0 {
		return nil, fmt.Errorf("%w (backend %s): nothing to put in a CDI spec", ErrNoGPUs, cfg.Backend)
	}
	spec := &specs.Spec{Kind: cfg.CDIKind}
	var all specs.ContainerEdits
	seen := map[string]bool{}
	for _, d := range devs {
		if d.UUID == "" {
			return nil, fmt.Errorf("GPU %d has no UUID", d.Index)
		}
		if seen[d.UUID] || seen[strconv.Itoa(d.Index)] {
			return nil, fmt.Errorf("GPU %d: duplicate index or uuid %q", d.Index, d.UUID)
		}
		seen[d.UUID], seen[strconv.Itoa(d.Index)] = true, true
		e, err := deviceEdits(cfg, d)
		if err != nil {
			return nil, err
		}
		// The index and the UUID name the same GPU, with the same edits.
		spec.Devices = append(spec.Devices,
			specs.Device{Name: strconv.Itoa(d.Index), ContainerEdits: e},
			specs.Device{Name: d.UUID, ContainerEdits: copyEdits(e)})
		all.Env = append(all.Env, e.Env...)
		all.DeviceNodes = append(all.DeviceNodes, copyEdits(e).DeviceNodes...)
		all.Mounts = append(all.Mounts, copyEdits(e).Mounts...)
	}
	spec.Devices = append(spec.Devices, specs.Device{Name: AllDevices, ContainerEdits: all})

	common := specs.ContainerEdits{Env: []string{EnvRunDir + "=" + cfg.RunDir}}
	for _, n := range controlNodes {
		common.DeviceNodes = append(common.DeviceNodes, deviceNode(cfg, n))
	}
	common.Mounts = []*specs.Mount{
		bindMount(ShimPath(cfg), ShimPath(cfg), "ro", "nosuid", "nodev", "bind"),
		bindMount(PreloadPath(cfg), "/etc/ld.so.preload", "ro", "nosuid", "nodev", "noexec", "bind"),
	}
	if o.hooks {
		var env []string
		if o.configPath != "" && o.configPath != config.DefaultPath {
			env = []string{config.EnvPath + "=" + o.configPath}
		}
		common.Hooks = []*specs.Hook{
			hook("createRuntime", HookPath(cfg), env, "create"),
			hook("poststop", HookPath(cfg), env, "destroy"),
		}
	}
	spec.ContainerEdits = common

	v, err := specs.MinimumRequiredVersion(spec)
	if err != nil {
		return nil, fmt.Errorf("cdi version: %w", err)
	}
	spec.Version = v
	return spec, nil
}

func deviceEdits(cfg *config.Config, d device.Info) (specs.ContainerEdits, error) {
	if len(d.Nodes) == 0 {
		return specs.ContainerEdits{}, fmt.Errorf("GPU %d (%s) has no device node", d.Index, d.UUID)
	}
	e := specs.ContainerEdits{Env: []string{DeviceEnvKey(d.Index) + "=" + d.UUID}}
	for _, n := range d.Nodes {
		e.DeviceNodes = append(e.DeviceNodes, deviceNode(cfg, n))
	}
	dir := ClientDir(cfg, d.Index)
	e.Mounts = []*specs.Mount{bindMount(dir, dir, "ro", "nosuid", "nodev", "noexec", "bind")}
	return e, nil
}

// deviceNode maps a host node to /dev/<name> in the container. Nodes whose
// numbers are fixed are given in full, so the spec applies even where the
// host node is missing (e.g. a rootless engine that cannot stat it); the
// engine reads the others from the host node.
func deviceNode(cfg *config.Config, host string) *specs.DeviceNode {
	n := &specs.DeviceNode{Path: "/dev/" + filepath.Base(host)}
	if n.Path != host {
		n.HostPath = host
	}
	base := filepath.Base(host)
	switch {
	case cfg.Backend == config.BackendSim:
		n.Type, n.Major, n.Minor = "c", device.SimNodeMajor, device.SimNodeMinor
	case base == "nvidiactl":
		n.Type, n.Major, n.Minor = "c", nvidiaMajor, nvidiactlMinor
	case strings.HasPrefix(base, "nvidia"):
		if m, err := strconv.Atoi(strings.TrimPrefix(base, "nvidia")); err == nil && m >= 0 && m < nvidiactlMinor {
			n.Type, n.Major, n.Minor = "c", nvidiaMajor, int64(m)
		}
	}
	return n
}

func bindMount(host, container string, options ...string) *specs.Mount {
	return &specs.Mount{HostPath: host, ContainerPath: container, Type: "bind", Options: options}
}

func hook(name, path string, env []string, verb string) *specs.Hook {
	t := HookTimeout
	return &specs.Hook{HookName: name, Path: path, Args: []string{HookBinary, verb}, Env: env, Timeout: &t}
}

// copyEdits deep-copies the parts of e that Generate shares between devices,
// so that no two devices of a spec alias the same node or mount.
func copyEdits(e specs.ContainerEdits) specs.ContainerEdits {
	out := specs.ContainerEdits{Env: append([]string(nil), e.Env...)}
	for _, n := range e.DeviceNodes {
		c := *n
		out.DeviceNodes = append(out.DeviceNodes, &c)
	}
	for _, m := range e.Mounts {
		c := *m
		c.Options = append([]string(nil), m.Options...)
		out.Mounts = append(out.Mounts, &c)
	}
	return out
}
