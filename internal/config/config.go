// Package config loads and validates the node configuration,
// /etc/mgpu/config.toml: a versioned TOML file with strict decoding (unknown
// keys are errors) and defaults kept in one place (Default).
package config

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

// DefaultPath is where the node configuration lives.
const DefaultPath = "/etc/mgpu/config.toml"

// EnvPath names the environment variable that overrides DefaultPath.
const EnvPath = "MGPU_CONFIG"

// Version is the only configuration version this build reads.
const Version = 1

// Backend names how GPUs are discovered.
const (
	BackendNVML = "nvml"
	BackendSim  = "sim"
)

// Config is the node configuration (version 1).
type Config struct {
	Version int `toml:"version"`
	// Backend is "nvml" (real GPUs through the NVIDIA driver) or "sim"
	// (GPUs described in [sim]).
	Backend string `toml:"backend"`
	// RunDir holds per-device sockets and regions: RunDir/gpuX/...
	RunDir string `toml:"run_dir"`
	// StateDir holds per-device instance tables: StateDir/gpuX/...
	StateDir string `toml:"state_dir"`
	// Prefix is the installation prefix of the binaries and the shim
	// (Prefix/bin/mgpu-hook, Prefix/lib/mgpu/libmgpu-shim.so).
	Prefix string `toml:"prefix"`
	// CDIKind is the CDI device kind, vendor/class.
	CDIKind string `toml:"cdi_kind"`
	// CDISpecDir is where `mgpu-cli cdi generate` writes the spec.
	CDISpecDir string `toml:"cdi_spec_dir"`

	Defaults DeviceSettings `toml:"defaults"`
	Devices  []DeviceConfig `toml:"device"`
	Sim      SimConfig      `toml:"sim"`
	Backstop BackstopConfig `toml:"backstop"`
	Metrics  MetricsConfig  `toml:"metrics"`

	// path is the file this configuration was read from ("" for defaults).
	path string
}

// DeviceSettings are the per-device settings; [defaults] sets them for every
// device and a [[device]] entry overrides them for one.
type DeviceSettings struct {
	// ComputePolicy is the device's compute policy.
	ComputePolicy policy.Policy `toml:"compute_policy"`
	// ComputeTimeslice is the arbitration period in milliseconds.
	ComputeTimeslice int `toml:"compute_timeslice"`
	// ComputeTimesliceNativeBurst is the native-burst-share slice in
	// microseconds.
	ComputeTimesliceNativeBurst int `toml:"compute_timeslice_native_burst"`
	// MaxInstances is the most instances the device admits.
	MaxInstances int `toml:"max_instances"`
	// OnlineOfflineSwitch is online/offline co-location: 0 (default) off,
	// every instance online (an offline one is refused); 1 on, offline
	// instances run on device time no online instance wants, with their
	// queue bound; 2 on, latency first: beside an online holder an offline
	// instance keeps one kernel in flight (docs/arbiter.md "Online and
	// offline instances").
	OnlineOfflineSwitch int `toml:"online_offline_switch"`
}

// DeviceConfig overrides the defaults for the device with the given index.
// Zero values inherit from [defaults].
type DeviceConfig struct {
	Index                       int            `toml:"index"`
	ComputePolicy               *policy.Policy `toml:"compute_policy"`
	ComputeTimeslice            int            `toml:"compute_timeslice"`
	ComputeTimesliceNativeBurst int            `toml:"compute_timeslice_native_burst"`
	MaxInstances                int            `toml:"max_instances"`
	OnlineOfflineSwitch         *int           `toml:"online_offline_switch"`
}

// SimConfig describes the simulated GPUs of the sim backend.
type SimConfig struct {
	GPUs []SimGPU `toml:"gpu"`
	// Topology is how the simulated GPUs are connected, as nvidia-smi topo
	// -m prints it: row i, column j is the link of GPUs i and j ("X" on
	// the diagonal; PIX, PXB, PHB, NODE or SYS elsewhere, symmetric).
	// Empty: every pair shares one host bridge (PHB).
	Topology [][]string `toml:"topology"`
}

// SimLinks are the values of a [sim] topology entry, nearest first (NVML's
// topology levels in nvidia-smi's words).
var SimLinks = []string{"X", "PIX", "PXB", "PHB", "NODE", "SYS"}

// SimGPU is one simulated GPU.
type SimGPU struct {
	Name      string `toml:"name"`
	MemoryMiB int64  `toml:"memory_mib"`
	// UUID is optional; the default is derived from the index (SimUUID).
	UUID string `toml:"uuid"`
}

// BackstopConfig configures the driver backstop of every enforcer
// (docs/backstop.md): what NVML reports of each process on the device is
// checked against the instance quotas.
type BackstopConfig struct {
	// Enabled runs the backstop.
	Enabled bool `toml:"enabled"`
	// Interval is how often the driver is sampled.
	Interval time.Duration `toml:"interval"`
	// Window is what the compute check judges over.
	Window time.Duration `toml:"window"`
	// ComputeTolerance is the GPU time an instance may take beyond what
	// was accounted for it, in percent of the window.
	ComputeTolerance int `toml:"compute_tolerance"`
	// MemoryAllowanceMiB is the device memory allowed per process beyond
	// the quota (the driver's own per-context memory), MiB.
	MemoryAllowanceMiB int64 `toml:"memory_allowance_mib"`
	// MemoryAllowanceProcesses is the most processes of one instance the
	// allowance counts for: the instance's limit is quota + allowance ×
	// min(its processes, this).
	MemoryAllowanceProcesses int `toml:"memory_allowance_processes"`
	// MemoryOnViolation, ComputeOnViolation and UnattributedOnViolation
	// are "log" or "kill".
	MemoryOnViolation       string `toml:"memory_on_violation"`
	ComputeOnViolation      string `toml:"compute_on_violation"`
	UnattributedOnViolation string `toml:"unattributed_on_violation"`
}

// MetricsConfig configures `mgpu-cli metrics serve`, the node's Prometheus
// exporter (docs/metrics.md).
type MetricsConfig struct {
	// Listen is the host:port it serves /metrics on. The default is on
	// loopback; a scraper elsewhere needs an address it can reach.
	Listen string `toml:"listen"`
}

// DefaultMetricsListen is where the exporter listens by default.
const DefaultMetricsListen = "127.0.0.1:9407"

// Validate checks Listen.
func (m MetricsConfig) Validate() error {
	host, port, err := net.SplitHostPort(m.Listen)
	if err == nil {
		var n int
		n, err = strconv.Atoi(port)
		if err == nil && (n < 0 || n > 65535) {
			err = fmt.Errorf("port %d outside 0..65535 (0: any free port)", n)
		}
	}
	if err == nil && host != "" && net.ParseIP(host) == nil && host != "localhost" {
		err = fmt.Errorf("host %q is not an IP address or localhost", host)
	}
	if err != nil {
		return &Error{Key: "metrics.listen", Err: fmt.Errorf("must be host:port (e.g. %q), got %q: %w", DefaultMetricsListen, m.Listen, err)}
	}
	return nil
}

// Actions of the backstop on a violation.
const (
	OnViolationLog  = "log"
	OnViolationKill = "kill"
)

// Limits of the settings, also used in error messages.
const (
	MinTimesliceMS                 = 1
	MaxTimesliceMS                 = 10000
	MinNativeTimesliceUS           = 100
	MaxNativeTimesliceUS           = 1000000
	MaxMaxInstances                = 128 // MGPU_REGION_MAX_PROCS bounds processes, not instances; keep tables small
	DefaultTimesliceMS             = 100
	DefaultNativeTimesliceUS       = 20000
	DefaultMaxInstances            = 16
	DefaultRunDir                  = "/run/mgpu"
	DefaultStateDir                = "/var/lib/mgpu"
	DefaultPrefix                  = "/usr"
	DefaultCDIKind                 = "mgpu.io/gpu"
	DefaultCDISpecDir              = "/var/run/cdi"
	defaultSimName                 = "Simulated-GPU-80GB"
	defaultSimMemoryMiB      int64 = 81920
)

// Limits and defaults of [backstop].
const (
	MinBackstopInterval         = 10 * time.Millisecond
	MaxBackstopInterval         = 10 * time.Second
	MaxBackstopWindow           = time.Minute
	MaxMemoryAllowanceMiB int64 = 65536
	// MaxMemoryAllowanceProcesses is the most processes a region holds
	// (region.MaxProcs): no more processes of an instance go through the
	// shim.
	MaxMemoryAllowanceProcesses = 128
	DefaultBackstopInterval     = 250 * time.Millisecond
	DefaultBackstopWindow       = time.Second
	DefaultComputeTolerance     = 10
	// DefaultMemoryAllowanceMiB is the allowance on real GPUs (backend
	// "nvml"): the driver charges every CUDA context memory the shim does
	// not count. On an H200 (driver 580, CUDA 13, PyTorch 2.11 with cuBLAS
	// loaded) that was 610 MiB per process, and with 512 a tenant holding
	// 4000 MiB of a 4096 MiB quota was killed (docs/backstop.md).
	DefaultMemoryAllowanceMiB int64 = 1024
	// DefaultSimMemoryAllowanceMiB is the allowance on the simulated GPU,
	// which charges exactly what is allocated.
	DefaultSimMemoryAllowanceMiB int64 = 0
	// DefaultMemoryAllowanceProcesses bounds an instance's slack over its
	// quota at 4 allowances (4 GiB on real GPUs), however many processes
	// skip the shim; an honest instance near its quota stays within it up
	// to 4 × 1024 / 610 = 6 PyTorch processes (docs/backstop.md).
	DefaultMemoryAllowanceProcesses = 4
	DefaultMemoryOnViolation        = OnViolationKill
	DefaultComputeOnViolation       = OnViolationLog
	DefaultUnattributedOnViolation  = OnViolationLog
)

// Default returns the configuration used when a key is not set.
func Default() *Config {
	return &Config{
		Version:    Version,
		Backend:    BackendNVML,
		RunDir:     DefaultRunDir,
		StateDir:   DefaultStateDir,
		Prefix:     DefaultPrefix,
		CDIKind:    DefaultCDIKind,
		CDISpecDir: DefaultCDISpecDir,
		Defaults: DeviceSettings{
			ComputePolicy:               policy.FixedShare,
			ComputeTimeslice:            DefaultTimesliceMS,
			ComputeTimesliceNativeBurst: DefaultNativeTimesliceUS,
			MaxInstances:                DefaultMaxInstances,
		},
		Backstop: BackstopConfig{
			Enabled:                  true,
			Interval:                 DefaultBackstopInterval,
			Window:                   DefaultBackstopWindow,
			ComputeTolerance:         DefaultComputeTolerance,
			MemoryAllowanceMiB:       DefaultMemoryAllowanceMiB,
			MemoryAllowanceProcesses: DefaultMemoryAllowanceProcesses,
			MemoryOnViolation:        DefaultMemoryOnViolation,
			ComputeOnViolation:       DefaultComputeOnViolation,
			UnattributedOnViolation:  DefaultUnattributedOnViolation,
		},
		Metrics: MetricsConfig{Listen: DefaultMetricsListen},
	}
}

// Path returns the file the configuration was loaded from, or "" when it
// holds defaults only.
func (c *Config) Path() string { return c.path }

// Device returns the effective settings of device index.
func (c *Config) Device(index int) DeviceSettings {
	s := c.Defaults
	for _, d := range c.Devices {
		if d.Index != index {
			continue
		}
		if d.ComputePolicy != nil {
			s.ComputePolicy = *d.ComputePolicy
		}
		if d.ComputeTimeslice != 0 {
			s.ComputeTimeslice = d.ComputeTimeslice
		}
		if d.ComputeTimesliceNativeBurst != 0 {
			s.ComputeTimesliceNativeBurst = d.ComputeTimesliceNativeBurst
		}
		if d.MaxInstances != 0 {
			s.MaxInstances = d.MaxInstances
		}
		if d.OnlineOfflineSwitch != nil {
			s.OnlineOfflineSwitch = *d.OnlineOfflineSwitch
		}
	}
	return s
}

// Period returns the arbitration period as a duration.
func (s DeviceSettings) Period() time.Duration {
	return time.Duration(s.ComputeTimeslice) * time.Millisecond
}

// NativeSlice returns the native-burst-share slice as a duration.
func (s DeviceSettings) NativeSlice() time.Duration {
	return time.Duration(s.ComputeTimesliceNativeBurst) * time.Microsecond
}

// DeviceRunDir is RunDir/gpuX.
func (c *Config) DeviceRunDir(index int) string {
	return filepath.Join(c.RunDir, fmt.Sprintf("gpu%d", index))
}

// DeviceStateDir is StateDir/gpuX.
func (c *Config) DeviceStateDir(index int) string {
	return filepath.Join(c.StateDir, fmt.Sprintf("gpu%d", index))
}

// SimUUID is the UUID of simulated GPU index when the config gives none. The
// simulated driver (test/fakecuda) derives the same value.
func SimUUID(index int) string {
	return fmt.Sprintf("GPU-5a1e0000-0000-4000-8000-%012x", index)
}

// Error is a configuration error: the file, the line (0 when unknown) and the
// key it is about.
type Error struct {
	File string
	Line int
	Key  string
	Err  error
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Line > 0 {
		fmt.Fprintf(&b, ":%d", e.Line)
	}
	if e.Key != "" {
		fmt.Fprintf(&b, ": key %q", e.Key)
	}
	fmt.Fprintf(&b, ": %v", e.Err)
	return b.String()
}

func (e *Error) Unwrap() error { return e.Err }

// ErrNotFound is returned (wrapped) by Load when the file does not exist.
var ErrNotFound = errors.New("configuration file not found")

// Resolve returns the configuration path to use: flag, then MGPU_CONFIG,
// then DefaultPath.
func Resolve(flagPath string) string {
	if flagPath != "" {
		return flagPath
	}
	if p := os.Getenv(EnvPath); p != "" {
		return p
	}
	return DefaultPath
}

// Load reads and validates the configuration at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path) //nolint:gosec // the path is the operator's choice
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, &Error{File: path, Err: fmt.Errorf("%w (create it, or pass --config / set %s)", ErrNotFound, EnvPath)}
		}
		return nil, &Error{File: path, Err: err}
	}
	return Parse(path, data)
}

// Parse decodes and validates configuration text; name is used in errors.
func Parse(name string, data []byte) (*Config, error) {
	c := Default()
	c.path = name
	lines := indexKeys(data)
	md, err := toml.NewDecoder(bytes.NewReader(data)).Decode(c)
	if err != nil {
		return nil, decodeError(name, data, lines, err)
	}
	if und := md.Undecoded(); len(und) > 0 {
		k := und[0].String()
		return nil, &Error{File: name, Line: lines.line(k), Key: k, Err: errors.New("unknown key")}
	}
	if !md.IsDefined("version") {
		return nil, &Error{File: name, Line: 1, Key: "version", Err: fmt.Errorf("missing; add version = %d", Version)}
	}
	if c.Backend == BackendSim && !md.IsDefined("backstop", "memory_allowance_mib") {
		c.Backstop.MemoryAllowanceMiB = DefaultSimMemoryAllowanceMiB
	}
	if err := c.validate(); err != nil {
		var ve *Error
		if errors.As(err, &ve) {
			ve.File = name
			if ve.Line == 0 {
				ve.Line = lines.line(ve.Key)
			}
		}
		return nil, err
	}
	return c, nil
}

func decodeError(name string, data []byte, lines keyLines, err error) error {
	var pe toml.ParseError
	if errors.As(err, &pe) {
		msg := pe.Message
		if msg == "" {
			msg = pe.Error()
		}
		line := pe.Position.Line
		// The library counts an unexpected newline as the start of the
		// next line; name the line the user has to fix.
		if st := pe.Position.Start; st >= 0 && st < len(data) {
			line = 1 + bytes.Count(data[:st], []byte("\n"))
		}
		e := &Error{File: name, Line: line, Err: errors.New(msg)}
		if pe.LastKey != "" {
			e.Key = pe.LastKey
		}
		return e
	}
	// Type and TextUnmarshaler errors carry the key in the message only
	// ("toml: line 3 (last key "defaults.compute_policy"): ...").
	msg := err.Error()
	key := ""
	if i := strings.Index(msg, `(last key "`); i >= 0 {
		rest := msg[i+len(`(last key "`):]
		if j := strings.Index(rest, `"`); j >= 0 {
			key = rest[:j]
		}
	}
	line := lines.line(key)
	if rest, ok := strings.CutPrefix(msg, "toml: line "); ok {
		digits := rest[:len(rest)-len(strings.TrimLeft(rest, "0123456789"))]
		if n, err := strconv.Atoi(digits); err == nil {
			line = n
		}
	}
	if i := strings.Index(msg, "): "); i >= 0 {
		msg = msg[i+3:]
	}
	msg = strings.TrimPrefix(msg, "toml: ")
	return &Error{File: name, Line: line, Key: key, Err: errors.New(msg)}
}

func (c *Config) validate() error {
	if c.Version != Version {
		return &Error{Key: "version", Err: fmt.Errorf("unsupported version %d (this build reads version %d)", c.Version, Version)}
	}
	switch c.Backend {
	case BackendNVML, BackendSim:
	default:
		return &Error{Key: "backend", Err: fmt.Errorf("unknown backend %q (want %q or %q)", c.Backend, BackendNVML, BackendSim)}
	}
	for _, d := range []struct{ key, val string }{
		{"run_dir", c.RunDir}, {"state_dir", c.StateDir}, {"prefix", c.Prefix}, {"cdi_spec_dir", c.CDISpecDir},
	} {
		if !filepath.IsAbs(d.val) {
			return &Error{Key: d.key, Err: fmt.Errorf("must be an absolute path, got %q", d.val)}
		}
	}
	if err := validateKind(c.CDIKind); err != nil {
		return &Error{Key: "cdi_kind", Err: err}
	}
	if err := validateSettings("defaults", c.Defaults, false); err != nil {
		return err
	}
	seen := map[int]bool{}
	for i, d := range c.Devices {
		key := fmt.Sprintf("device[%d]", i)
		if d.Index < 0 {
			return &Error{Key: key + ".index", Err: fmt.Errorf("must be >= 0, got %d", d.Index)}
		}
		if seen[d.Index] {
			return &Error{Key: key + ".index", Err: fmt.Errorf("duplicate device index %d", d.Index)}
		}
		seen[d.Index] = true
		s := DeviceSettings{
			ComputeTimeslice:            d.ComputeTimeslice,
			ComputeTimesliceNativeBurst: d.ComputeTimesliceNativeBurst,
			MaxInstances:                d.MaxInstances,
		}
		if d.ComputePolicy != nil {
			s.ComputePolicy = *d.ComputePolicy
		}
		if d.OnlineOfflineSwitch != nil {
			s.OnlineOfflineSwitch = *d.OnlineOfflineSwitch
		}
		if err := validateSettings(key, s, true); err != nil {
			return err
		}
	}
	if err := c.Backstop.validate(); err != nil {
		return err
	}
	if err := c.Metrics.Validate(); err != nil {
		return err
	}
	if c.Backend == BackendSim && len(c.Sim.GPUs) == 0 {
		return &Error{Key: "backend", Err: errors.New(`backend = "sim" needs at least one [[sim.gpu]] table`)}
	}
	uuids := map[string]bool{}
	for i, g := range c.Sim.GPUs {
		key := fmt.Sprintf("sim.gpu[%d]", i)
		if g.Name == "" {
			c.Sim.GPUs[i].Name = defaultSimName
		}
		switch {
		case g.MemoryMiB == 0:
			c.Sim.GPUs[i].MemoryMiB = defaultSimMemoryMiB
		case g.MemoryMiB < 0:
			return &Error{Key: key + ".memory_mib", Err: fmt.Errorf("must be positive, got %d", g.MemoryMiB)}
		case g.MemoryMiB > 1<<24:
			return &Error{Key: key + ".memory_mib", Err: fmt.Errorf("%d MiB is more than any GPU has (max %d)", g.MemoryMiB, 1<<24)}
		}
		if g.UUID == "" {
			c.Sim.GPUs[i].UUID = SimUUID(i)
		} else if !strings.HasPrefix(g.UUID, "GPU-") || len(g.UUID) < 8 {
			return &Error{Key: key + ".uuid", Err: fmt.Errorf("must look like GPU-<uuid>, got %q", g.UUID)}
		}
		if uuids[c.Sim.GPUs[i].UUID] {
			return &Error{Key: key + ".uuid", Err: fmt.Errorf("duplicate uuid %q", c.Sim.GPUs[i].UUID)}
		}
		uuids[c.Sim.GPUs[i].UUID] = true
	}
	return c.Sim.validateTopology()
}

// validateTopology checks [sim] topology: one row and one column per GPU,
// X exactly on the diagonal, known links, symmetric.
func (s SimConfig) validateTopology() error {
	t := s.Topology
	if len(t) == 0 {
		return nil
	}
	n := len(s.GPUs)
	if len(t) != n {
		return &Error{Key: "sim.topology", Err: fmt.Errorf("has %d rows for %d GPUs; want one row per [[sim.gpu]]", len(t), n)}
	}
	for i, row := range t {
		if len(row) != n {
			return &Error{Key: fmt.Sprintf("sim.topology[%d]", i), Err: fmt.Errorf("has %d entries for %d GPUs", len(row), n)}
		}
		for j, v := range row {
			key := fmt.Sprintf("sim.topology[%d][%d]", i, j)
			switch {
			case !slices.Contains(SimLinks, v):
				return &Error{Key: key, Err: fmt.Errorf("unknown link %q (want one of %s)", v, strings.Join(SimLinks, ", "))}
			case (i == j) != (v == "X"):
				return &Error{Key: key, Err: fmt.Errorf("%q: X is a GPU's link to itself, and only that", v)}
			case t[j][i] != v:
				return &Error{Key: key, Err: fmt.Errorf("%q, but sim.topology[%d][%d] is %q; links go both ways", v, j, i, t[j][i])}
			}
		}
	}
	return nil
}

// validateSettings checks one settings block; in an override, zero means
// "inherit".
func validateSettings(prefix string, s DeviceSettings, override bool) error {
	if !s.ComputePolicy.Valid() {
		return &Error{Key: prefix + ".compute_policy", Err: fmt.Errorf("invalid compute policy %d", uint32(s.ComputePolicy))}
	}
	// outside reports a value out of lo..hi; in an override 0 inherits.
	outside := func(v, lo, hi int) bool { return (!override || v != 0) && (v < lo || v > hi) }
	if outside(s.ComputeTimeslice, MinTimesliceMS, MaxTimesliceMS) {
		return &Error{Key: prefix + ".compute_timeslice", Err: fmt.Errorf("must be %d..%d (milliseconds), got %d", MinTimesliceMS, MaxTimesliceMS, s.ComputeTimeslice)}
	}
	if outside(s.ComputeTimesliceNativeBurst, MinNativeTimesliceUS, MaxNativeTimesliceUS) {
		return &Error{Key: prefix + ".compute_timeslice_native_burst", Err: fmt.Errorf("must be %d..%d (microseconds), got %d", MinNativeTimesliceUS, MaxNativeTimesliceUS, s.ComputeTimesliceNativeBurst)}
	}
	if outside(s.MaxInstances, 1, MaxMaxInstances) {
		return &Error{Key: prefix + ".max_instances", Err: fmt.Errorf("must be 1..%d, got %d", MaxMaxInstances, s.MaxInstances)}
	}
	if s.OnlineOfflineSwitch < 0 || s.OnlineOfflineSwitch > 2 {
		return &Error{Key: prefix + ".online_offline_switch", Err: fmt.Errorf("must be 0 (off), 1 (offline instances use the time online ones leave) or 2 (the same, one offline kernel in flight beside an online instance), got %d", s.OnlineOfflineSwitch)}
	}
	return nil
}

func (b BackstopConfig) validate() error {
	if b.Interval < MinBackstopInterval || b.Interval > MaxBackstopInterval {
		return &Error{Key: "backstop.interval", Err: fmt.Errorf("must be a duration %v..%v (e.g. %q), got %v", MinBackstopInterval, MaxBackstopInterval, "250ms", b.Interval)}
	}
	if b.Window < b.Interval || b.Window > MaxBackstopWindow {
		return &Error{Key: "backstop.window", Err: fmt.Errorf("must be a duration from backstop.interval (%v) to %v (e.g. %q), got %v", b.Interval, MaxBackstopWindow, "1s", b.Window)}
	}
	if b.ComputeTolerance < 0 || b.ComputeTolerance > 100 {
		return &Error{Key: "backstop.compute_tolerance", Err: fmt.Errorf("must be 0..100 (percent of the window), got %d", b.ComputeTolerance)}
	}
	if b.MemoryAllowanceMiB < 0 || b.MemoryAllowanceMiB > MaxMemoryAllowanceMiB {
		return &Error{Key: "backstop.memory_allowance_mib", Err: fmt.Errorf("must be 0..%d (MiB per process), got %d", MaxMemoryAllowanceMiB, b.MemoryAllowanceMiB)}
	}
	if b.MemoryAllowanceProcesses < 1 || b.MemoryAllowanceProcesses > MaxMemoryAllowanceProcesses {
		return &Error{Key: "backstop.memory_allowance_processes", Err: fmt.Errorf("must be 1..%d (processes per instance), got %d", MaxMemoryAllowanceProcesses, b.MemoryAllowanceProcesses)}
	}
	for _, a := range []struct{ key, val string }{
		{"memory_on_violation", b.MemoryOnViolation},
		{"compute_on_violation", b.ComputeOnViolation},
		{"unattributed_on_violation", b.UnattributedOnViolation},
	} {
		if a.val != OnViolationLog && a.val != OnViolationKill {
			return &Error{Key: "backstop." + a.key, Err: fmt.Errorf("unknown action %q (want %q or %q)", a.val, OnViolationLog, OnViolationKill)}
		}
	}
	return nil
}

// MemoryAllowance is MemoryAllowanceMiB in bytes.
func (b BackstopConfig) MemoryAllowance() uint64 { return uint64(b.MemoryAllowanceMiB) << 20 }

func validateKind(kind string) error {
	vendor, class, ok := strings.Cut(kind, "/")
	if !ok || vendor == "" || class == "" || strings.Contains(class, "/") {
		return fmt.Errorf("must be vendor/class, e.g. %q, got %q", DefaultCDIKind, kind)
	}
	return nil
}
