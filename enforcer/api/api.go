// Package api defines the enforcer's control API (versioned HTTP/JSON over
// the root-only unix socket /run/mgpu/gpuX/control.sock), the request
// decoder the enforcer uses, and the Go client mgpu-cli and the OCI hook
// use. docs/control-api.md documents every endpoint.
package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

// Version is the API version, the first element of every path (/v1/...).
const Version = "v1"

// Files of a device's run directory (config.DeviceRunDir).
const (
	ControlSocketName = "control.sock"  // 0600, root only
	ClientDirName     = "client"        // 0755, the only part mounted into containers
	ClientSocketName  = "client.sock"   // 0666, inside ClientDirName
	RegionsDirName    = "regions"       // 0700, one region directory per instance
	LockFileName      = "enforcer.lock" // flock: one enforcer per device
)

// ControlSocket returns the control socket of the device whose run directory
// is devRunDir.
func ControlSocket(devRunDir string) string { return filepath.Join(devRunDir, ControlSocketName) }

// ClientSocket returns the client (attach) socket of the device.
func ClientSocket(devRunDir string) string {
	return filepath.Join(devRunDir, ClientDirName, ClientSocketName)
}

// InstanceName returns mgpuXinstY.
func InstanceName(dev, id int) string { return fmt.Sprintf("mgpu%dinst%d", dev, id) }

// ParseInstanceName splits mgpuXinstY.
func ParseInstanceName(s string) (dev, id int, err error) {
	rest, ok := strings.CutPrefix(s, "mgpu")
	x, y, ok2 := strings.Cut(rest, "inst")
	if ok && ok2 {
		dev, err1 := strconv.Atoi(x)
		id, err2 := strconv.Atoi(y)
		if err1 == nil && err2 == nil && dev >= 0 && id >= 0 && InstanceName(dev, id) == s {
			return dev, id, nil
		}
	}
	return 0, 0, fmt.Errorf("%q is not an instance name (want mgpuXinstY)", s)
}

// Kind says how an instance's processes are recognised.
type Kind string

const (
	// KindContainer recognises processes in the container's pid namespace,
	// or (same pid namespace as the enforcer) in its cgroup.
	KindContainer Kind = "container"
	// KindProcessTree recognises the registered root process and its
	// descendants (mgpu-cli run).
	KindProcessTree Kind = "process-tree"
)

// CreateRequest is the body of POST /v1/instances.
type CreateRequest struct {
	// Kind defaults to "container".
	Kind Kind `json:"kind,omitempty"`
	// ContainerID identifies the container (required for containers,
	// optional label for process trees). Creating an instance for a
	// container id that has one returns the existing instance.
	ContainerID string `json:"container_id,omitempty"`
	// PID is the container's init pid, or the process tree's root, as seen
	// from the host. The enforcer reads its start time, pid namespace and
	// cgroup from /proc.
	PID int `json:"pid"`
	// Cgroup optionally overrides the cgroup read from /proc/<pid>/cgroup
	// (a path as /proc/<pid>/cgroup shows it, e.g. /system.slice/x.scope).
	Cgroup string `json:"cgroup,omitempty"`
	// Policy the workload asks for; "" means the device's.
	Policy string `json:"policy,omitempty"`
	// Core is the compute quota or weight, 1..100.
	Core int `json:"core"`
	// MemoryMiB is the device-memory quota, >= 1.
	MemoryMiB uint64 `json:"memory_mib"`
	// Class is the instance's priority class, "online" (also "") or
	// "offline" (a device with online_offline_switch = 1 only).
	Class string `json:"class,omitempty"`
	// Pod is the Kubernetes pod container the instance is for, when a
	// CRI made the container (the hook reads it from the CRI's
	// annotations); labels of the instance's metrics.
	Pod *PodRef `json:"pod,omitempty"`
	// UUID, when set, is the GPU the caller means (the hook sends the
	// CDI spec's): the enforcer refuses the create if its device is
	// another, e.g. after the GPUs changed under an old CDI spec.
	UUID string `json:"uuid,omitempty"`
}

// PodRef names a Kubernetes pod's container.
type PodRef struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Container string `json:"container"`
	// Claim is the DRA ResourceClaim (in Namespace) whose share the
	// instance is; "" when none.
	Claim string `json:"claim,omitempty"`
}

// MaxPodRefLen bounds each PodRef field (a DNS subdomain is at most 253).
const MaxPodRefLen = 253

// Validate checks that every field but Claim is set, and that each is
// printable and at most MaxPodRefLen bytes.
func (p *PodRef) Validate() error {
	for _, f := range []struct{ key, val string }{{"namespace", p.Namespace}, {"name", p.Name}, {"container", p.Container}, {"claim", p.Claim}} {
		if f.key == "claim" && f.val == "" {
			continue
		}
		if f.val == "" || len(f.val) > MaxPodRefLen {
			return fmt.Errorf("%w: pod %s must be 1 to %d bytes", ErrBadRequest, f.key, MaxPodRefLen)
		}
		for _, c := range f.val {
			if !unicode.IsPrint(c) || c == ' ' {
				return fmt.Errorf("%w: pod %s %q has a character that is not printable", ErrBadRequest, f.key, f.val)
			}
		}
	}
	return nil
}

// Instance describes one instance.
type Instance struct {
	Name        string    `json:"name"` // mgpuXinstY
	Device      int       `json:"device"`
	ID          int       `json:"id"`
	Kind        Kind      `json:"kind"`
	ContainerID string    `json:"container_id,omitempty"`
	PID         int       `json:"pid"`        // init / root pid (host)
	StartTime   uint64    `json:"start_time"` // of PID, clock ticks after boot
	PidNS       uint64    `json:"pid_ns,omitempty"`
	Cgroup      string    `json:"cgroup,omitempty"`
	Policy      string    `json:"policy"`
	Core        int       `json:"core"`
	MemoryMiB   uint64    `json:"memory_mib"`
	Class       string    `json:"class"` // online or offline
	Created     time.Time `json:"created"`
	Processes   int       `json:"processes"` // attached processes
	Region      string    `json:"region"`    // region directory on the host
	Pod         *PodRef   `json:"pod,omitempty"`
}

// CreateResponse is the answer to POST /v1/instances.
type CreateResponse struct {
	Instance Instance `json:"instance"`
	// Existing is true when the container already had this instance.
	Existing bool `json:"existing"`
}

// ListResponse is the answer to GET /v1/instances.
type ListResponse struct {
	Instances []Instance `json:"instances"`
}

// DestroyResponse is the answer to DELETE /v1/instances/{name} and
// DELETE /v1/instances?container_id=ID.
type DestroyResponse struct {
	// Released is false when there was no such instance (destroy is
	// idempotent).
	Released bool   `json:"released"`
	Name     string `json:"name,omitempty"`
}

// DeviceResponse is the answer to GET /v1/device: the live numbers of
// `mgpu-cli device info`.
type DeviceResponse struct {
	Index     int    `json:"index"`
	UUID      string `json:"uuid"`
	Name      string `json:"name"`
	MemoryMiB uint64 `json:"memory_mib"`

	// Policy is the policy the device runs now. ConfiguredPolicy is the
	// node config's; it differs while a policy change waits for the device
	// to become empty.
	Policy           string `json:"policy"`
	PolicyCode       int    `json:"policy_code"`
	ConfiguredPolicy string `json:"configured_policy"`
	TimesliceMS      int    `json:"compute_timeslice_ms"`
	NativeSliceUS    int    `json:"compute_timeslice_native_burst_us"`
	MaxInstances     int    `json:"max_instances"`
	// OnlineOfflineSwitch is the online_offline_switch the device runs
	// (0 off, 1 offline instances admitted).
	OnlineOfflineSwitch int `json:"online_offline_switch"`

	Instances int `json:"instances"`
	// CoreSum is the sum of the online instances' cores, which admission
	// keeps within 100 (fixed-share, guaranteed-burst-share); CoreFree is
	// 100 - CoreSum, >= 0. OfflineCoreSum is the offline instances' (their
	// weights among themselves).
	CoreSum            int    `json:"core_sum"`
	CoreFree           int    `json:"core_free"`
	OfflineCoreSum     int    `json:"offline_core_sum"`
	MemoryAllocatedMiB uint64 `json:"memory_allocated_mib"`
	MemoryFreeMiB      uint64 `json:"memory_free_mib"`

	EnforcerPID   int       `json:"enforcer_pid"`
	EnforcerEpoch uint32    `json:"enforcer_epoch"`
	Started       time.Time `json:"started"`

	// BusyNs is the measured GPU time of the device's instances, released
	// ones included, since the enforcer started.
	BusyNs uint64 `json:"busy_ns"`
}

// StatsResponse is the answer to GET /v1/stats.
type StatsResponse struct {
	Instances []InstanceStats `json:"instances"`
}

// InstanceStats are one instance's live accounting. Durations are in
// nanoseconds.
type InstanceStats struct {
	Name string `json:"name"`
	Core int    `json:"core"`
	// GrantedNs: time the instance held the grant (arbiter).
	GrantedNs int64 `json:"granted_ns"`
	// GPUNs: measured GPU time, all processes, dead ones included.
	GPUNs uint64 `json:"gpu_ns"`
	// ThrottledNs: time the shim's threads waited for a grant (sum over
	// threads and processes).
	ThrottledNs uint64 `json:"throttled_ns"`
	// DemandThrottledNs: wall time the instance had demand but no grant
	// (arbiter).
	DemandThrottledNs int64     `json:"demand_throttled_ns"`
	QueuedNs          uint64    `json:"queued_ns"`
	Launches          uint64    `json:"launches"`
	Holding           bool      `json:"holding"`
	MemoryUsedBytes   uint64    `json:"memory_used_bytes"`
	MemoryLimitBytes  uint64    `json:"memory_limit_bytes"`
	Processes         []Process `json:"processes"`
	// Violations counts the driver backstop's violations of the instance
	// since the enforcer started (episodes, every kind; 0 with the
	// backstop off).
	Violations uint64 `json:"violations"`
}

// Process is one attached process.
type Process struct {
	PID              int    `json:"pid"`
	Slot             int    `json:"slot"`
	GPUNs            uint64 `json:"gpu_ns"`
	MemReservedBytes uint64 `json:"mem_reserved_bytes"`
	Launches         uint64 `json:"launches"`
	ThrottledNs      uint64 `json:"throttled_ns"`
	Waiting          uint32 `json:"waiting"`
}

// ErrorResponse is the body of every 4xx/5xx answer.
type ErrorResponse struct {
	Error string `json:"error"`
}

// MaxRequestBytes bounds a request body.
const MaxRequestBytes = 64 << 10

// Limits of CreateRequest strings.
const (
	MaxContainerIDLen = 1024
	MaxCgroupLen      = 4096
	MaxUUIDLen        = 128
)

// ErrBadRequest is returned (wrapped) by DecodeCreateRequest.
var ErrBadRequest = errors.New("bad request")

// DecodeCreateRequest reads exactly one JSON object (unknown fields are
// errors) of at most MaxRequestBytes and checks its syntax: kind, pid,
// container id, cgroup and policy. Quotas are checked by admission, which
// knows the device.
func DecodeCreateRequest(r io.Reader) (CreateRequest, error) {
	var req CreateRequest
	data, err := io.ReadAll(io.LimitReader(r, MaxRequestBytes+1))
	if err != nil {
		return req, fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	if len(data) > MaxRequestBytes {
		return req, fmt.Errorf("%w: body larger than %d bytes", ErrBadRequest, MaxRequestBytes)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return req, fmt.Errorf("%w: %s", ErrBadRequest, strings.TrimPrefix(err.Error(), "json: "))
	}
	if dec.More() {
		return req, fmt.Errorf("%w: data after the JSON object", ErrBadRequest)
	}
	if _, err := dec.Token(); err != io.EOF {
		return req, fmt.Errorf("%w: data after the JSON object", ErrBadRequest)
	}
	if err := req.Validate(); err != nil {
		return req, err
	}
	return req, nil
}

// Validate checks the syntax of the request and fills the default kind.
func (r *CreateRequest) Validate() error {
	if r.Kind == "" {
		r.Kind = KindContainer
	}
	switch r.Kind {
	case KindContainer:
		if r.ContainerID == "" {
			return fmt.Errorf("%w: container_id is required for kind %q", ErrBadRequest, KindContainer)
		}
	case KindProcessTree:
	default:
		return fmt.Errorf("%w: unknown kind %q (want %q or %q)", ErrBadRequest, r.Kind, KindContainer, KindProcessTree)
	}
	if len(r.ContainerID) > MaxContainerIDLen {
		return fmt.Errorf("%w: container_id longer than %d bytes", ErrBadRequest, MaxContainerIDLen)
	}
	for _, c := range r.ContainerID {
		if !unicode.IsPrint(c) || c == ' ' {
			return fmt.Errorf("%w: container_id %q has a character that is not printable", ErrBadRequest, r.ContainerID)
		}
	}
	if r.PID <= 0 || r.PID > 1<<22 {
		return fmt.Errorf("%w: pid must be a host pid (1..%d), got %d", ErrBadRequest, 1<<22, r.PID)
	}
	if r.Cgroup != "" {
		if len(r.Cgroup) > MaxCgroupLen || !strings.HasPrefix(r.Cgroup, "/") || path.Clean(r.Cgroup) != r.Cgroup || r.Cgroup == "/" {
			return fmt.Errorf("%w: cgroup %q must be a clean absolute path below /", ErrBadRequest, r.Cgroup)
		}
	}
	if r.Policy != "" {
		if _, err := policy.Parse(r.Policy); err != nil {
			return fmt.Errorf("%w: %w", ErrBadRequest, err)
		}
	}
	if r.Class != "" {
		if _, err := policy.ParseClass(r.Class); err != nil {
			return fmt.Errorf("%w: %w", ErrBadRequest, err)
		}
	}
	if len(r.UUID) > MaxUUIDLen {
		return fmt.Errorf("%w: uuid longer than %d bytes", ErrBadRequest, MaxUUIDLen)
	}
	for _, c := range r.UUID {
		if !unicode.IsPrint(c) || c == ' ' {
			return fmt.Errorf("%w: uuid %q has a character that is not printable", ErrBadRequest, r.UUID)
		}
	}
	if r.Pod != nil {
		if r.Kind != KindContainer {
			return fmt.Errorf("%w: pod is for kind %q only", ErrBadRequest, KindContainer)
		}
		if err := r.Pod.Validate(); err != nil {
			return err
		}
	}
	return nil
}
