package hook

import (
	"fmt"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/mgpu-dev/mgpu/cdi/cdienv"
	"github.com/mgpu-dev/mgpu/internal/config"
)

// maxDeviceIndex bounds the X of MGPU_DEVICE_X.
const maxDeviceIndex = 1 << 16

// Device is one GPU a container was given through the CDI spec.
type Device struct {
	Index int
	// UUID is the value of MGPU_DEVICE_<Index>, the GPU's UUID.
	UUID string
}

// DeviceError is a container spec whose mgpu devices are inconsistent.
type DeviceError struct{ msg string }

func (e *DeviceError) Error() string { return e.msg }

func deviceErrorf(format string, a ...any) error { return &DeviceError{fmt.Sprintf(format, a...)} }

// RequestedDevices lists the GPUs the CDI spec gave the container, sorted
// by index. The CDI spec (package cdi) sets, for each requested GPU X, the
// env key MGPU_DEVICE_X=<uuid> and a bind mount of <run_dir>/gpuX/client;
// a device counts only when both are present, since a container without the
// mount cannot reach the enforcer and one without the key did not ask for
// the device. A key without its mount, a malformed key, or a
// MGPU_RUN_DIR that differs from the node's run_dir (a CDI spec generated
// from another configuration) is an error. No key at all is no device: the
// hook has nothing to do.
func RequestedDevices(cfg *config.Config, spec *oci.Spec) ([]Device, error) {
	var env []string
	if spec.Process != nil {
		env = spec.Process.Env
	}
	var devs []Device
	seen := map[int]string{}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		suffix, ok := strings.CutPrefix(k, cdienv.DevicePrefix)
		if !ok {
			continue
		}
		n, valid := parseDecimal(suffix, maxDeviceIndex)
		if !valid || (len(suffix) > 1 && suffix[0] == '0') {
			return nil, deviceErrorf("%s is not a device key of the mgpu CDI spec (%s<index>); remove it from the container's environment", shownKey(k), cdienv.DevicePrefix)
		}
		idx := int(n)
		if v == "" {
			return nil, deviceErrorf("%s is empty; the mgpu CDI spec sets it to the GPU's UUID (request the GPU with --device %s=%d)", k, cfg.CDIKind, idx)
		}
		if prev, dup := seen[idx]; dup {
			if prev != v {
				return nil, &EnvError{Key: k, First: prev, Second: v}
			}
			continue
		}
		seen[idx] = v
		devs = append(devs, Device{Index: idx, UUID: v})
	}
	if len(devs) == 0 {
		return nil, nil
	}
	sort.Slice(devs, func(i, j int) bool { return devs[i].Index < devs[j].Index })

	runDir, found, err := LookupEnv(env, cdienv.RunDir)
	if err != nil {
		return nil, err
	}
	if found && filepath.Clean(runDir) != filepath.Clean(cfg.RunDir) {
		return nil, deviceErrorf("the container's %s is %q but %s has run_dir = %q; regenerate the CDI spec (mgpu-cli cdi generate) from the node's configuration",
			cdienv.RunDir, runDir, configName(cfg), cfg.RunDir)
	}
	mounted := map[string]bool{}
	for _, m := range spec.Mounts {
		mounted[filepath.Clean(m.Source)+"\x00"+filepath.Clean(m.Destination)] = true
	}
	for _, d := range devs {
		dir := cdienv.ClientDir(cfg, d.Index)
		if !mounted[dir+"\x00"+dir] {
			return nil, deviceErrorf("%s is set but %s is not mounted into the container; request GPUs through CDI (--device %s=%d), not by setting %s",
				cdienv.DeviceKey(d.Index), dir, cfg.CDIKind, d.Index, cdienv.DeviceKey(d.Index))
		}
	}
	return devs, nil
}

// shownKey is an environment key as a message shows it: as it is, or
// quoted when it has a character that needs escaping (a line break in a
// tenant's key must not split the hook's one-line message).
func shownKey(k string) string {
	if q := strconv.Quote(k); q[1:len(q)-1] != k {
		return q
	}
	return k
}

func configName(cfg *config.Config) string {
	if p := cfg.Path(); p != "" {
		return p
	}
	return "the node configuration"
}

// DeviceIndexes returns the indexes of devs, for messages.
func DeviceIndexes(devs []Device) string {
	s := make([]string, len(devs))
	for i, d := range devs {
		s[i] = strconv.Itoa(d.Index)
	}
	return strings.Join(s, ",")
}
