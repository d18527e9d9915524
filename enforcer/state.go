package enforcer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/policy"
)

// StateFileName is the instance table in the device's state directory.
const StateFileName = "instances.json"

// StateVersion is the only state file version this build reads and writes.
const StateVersion = 1

// maxStateBytes bounds the state file (128 instances of a few hundred bytes).
const maxStateBytes = 4 << 20

// maxInstanceID bounds instance ids in a state file.
const maxInstanceID = 1 << 16

// stateFile is the persisted instance table of one device.
type stateFile struct {
	Version int    `json:"version"`
	Device  int    `json:"device"`
	BootID  string `json:"boot_id"`
	Epoch   uint32 `json:"epoch"`
	// The settings the instances run under; a config that differs takes
	// effect when the device is empty.
	Policy        policy.Policy   `json:"policy"`
	TimesliceMS   int             `json:"compute_timeslice_ms"`
	NativeSliceUS int             `json:"compute_timeslice_native_burst_us"`
	OnlineOffline int             `json:"online_offline_switch,omitempty"`
	Instances     []stateInstance `json:"instances"`
}

type stateInstance struct {
	Name        string        `json:"name"`
	ID          int           `json:"id"`
	Kind        api.Kind      `json:"kind"`
	ContainerID string        `json:"container_id,omitempty"`
	Pod         *api.PodRef   `json:"pod,omitempty"`
	PID         int           `json:"pid"`
	StartTime   uint64        `json:"start_time"`
	PidNS       uint64        `json:"pid_ns,omitempty"`
	Cgroup      string        `json:"cgroup,omitempty"`
	Policy      policy.Policy `json:"policy"`
	Class       policy.Class  `json:"class,omitempty"`
	Core        int           `json:"core"`
	MemoryMiB   uint64        `json:"memory_mib"`
	Created     time.Time     `json:"created"`
	// Counters of processes that were reaped, so that the instance's
	// totals stay monotonic across enforcer restarts.
	ReapedGPUNs       uint64 `json:"reaped_gpu_ns"`
	ReapedThrottledNs uint64 `json:"reaped_throttled_ns"`
	ReapedLaunches    uint64 `json:"reaped_launches"`
}

// CorruptStateError is a state file that cannot be trusted. The enforcer
// refuses to start rather than discard it.
type CorruptStateError struct {
	Path   string
	Device int
	Err    error
}

func (e *CorruptStateError) Error() string {
	return fmt.Sprintf("state file %s is corrupt (%v); to recover, move it aside (device %d then starts empty and running workloads on it lose their quotas) or restore a good copy, then start mgpu-enforcer again",
		e.Path, e.Err, e.Device)
}

func (e *CorruptStateError) Unwrap() error { return e.Err }

// decodeState parses and validates a state file of device dev.
func decodeState(data []byte, dev int) (*stateFile, error) {
	if len(data) > maxStateBytes {
		return nil, fmt.Errorf("larger than %d bytes", maxStateBytes)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var s stateFile
	if err := dec.Decode(&s); err != nil {
		return nil, fmt.Errorf("%s", trimJSON(err))
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("data after the JSON object")
	}
	if s.Version != StateVersion {
		return nil, fmt.Errorf("version %d, this build reads version %d", s.Version, StateVersion)
	}
	if s.Device != dev {
		return nil, fmt.Errorf("it belongs to device %d, not %d", s.Device, dev)
	}
	if !s.Policy.Valid() {
		return nil, fmt.Errorf("invalid policy %d", uint32(s.Policy))
	}
	if s.TimesliceMS < config.MinTimesliceMS || s.TimesliceMS > config.MaxTimesliceMS {
		return nil, fmt.Errorf("compute_timeslice_ms %d outside %d..%d", s.TimesliceMS, config.MinTimesliceMS, config.MaxTimesliceMS)
	}
	if s.NativeSliceUS < config.MinNativeTimesliceUS || s.NativeSliceUS > config.MaxNativeTimesliceUS {
		return nil, fmt.Errorf("compute_timeslice_native_burst_us %d outside %d..%d", s.NativeSliceUS, config.MinNativeTimesliceUS, config.MaxNativeTimesliceUS)
	}
	if s.OnlineOffline != 0 && s.OnlineOffline != 1 {
		return nil, fmt.Errorf("online_offline_switch %d outside 0..1", s.OnlineOffline)
	}
	ids := map[int]bool{}
	cids := map[string]bool{}
	for i, in := range s.Instances {
		where := fmt.Sprintf("instances[%d]", i)
		switch {
		case in.ID < 0 || in.ID >= maxInstanceID:
			return nil, fmt.Errorf("%s: id %d outside 0..%d", where, in.ID, maxInstanceID-1)
		case ids[in.ID]:
			return nil, fmt.Errorf("%s: duplicate id %d", where, in.ID)
		case in.Name != api.InstanceName(dev, in.ID):
			return nil, fmt.Errorf("%s: name %q does not match id %d", where, in.Name, in.ID)
		case in.Kind != api.KindContainer && in.Kind != api.KindProcessTree:
			return nil, fmt.Errorf("%s: unknown kind %q", where, in.Kind)
		case in.Kind == api.KindContainer && in.ContainerID == "":
			return nil, fmt.Errorf("%s: container without container_id", where)
		case in.ContainerID != "" && cids[in.ContainerID]:
			return nil, fmt.Errorf("%s: duplicate container_id %q", where, in.ContainerID)
		case in.PID <= 0:
			return nil, fmt.Errorf("%s: pid %d", where, in.PID)
		case in.Core < 1 || in.Core > 100:
			return nil, fmt.Errorf("%s: core %d outside 1..100", where, in.Core)
		case in.MemoryMiB < 1 || in.MemoryMiB > 1<<24:
			return nil, fmt.Errorf("%s: memory_mib %d outside 1..%d", where, in.MemoryMiB, 1<<24)
		case in.Policy != s.Policy:
			return nil, fmt.Errorf("%s: policy %s differs from the device's %s", where, in.Policy, s.Policy)
		case !in.Class.Valid() || (in.Class == policy.Offline && s.OnlineOffline == 0):
			return nil, fmt.Errorf("%s: class %s on a device of online_offline_switch %d", where, in.Class, s.OnlineOffline)
		}
		if in.Pod != nil {
			if err := in.Pod.Validate(); err != nil {
				return nil, fmt.Errorf("%s: %w", where, err)
			}
		}
		ids[in.ID] = true
		if in.ContainerID != "" {
			cids[in.ContainerID] = true
		}
	}
	return &s, nil
}

func trimJSON(err error) string {
	s := err.Error()
	if len(s) > 5 && s[:5] == "json:" {
		s = s[6:]
	}
	return s
}

// loadState reads the state file; a missing file is an empty table.
func loadState(path string, dev int) (*stateFile, error) {
	data, err := os.ReadFile(path) //nolint:gosec // the enforcer's own state directory
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read state: %w", err)
	}
	s, err := decodeState(data, dev)
	if err != nil {
		return nil, &CorruptStateError{Path: path, Device: dev, Err: err}
	}
	return s, nil
}
