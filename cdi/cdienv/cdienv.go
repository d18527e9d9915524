// Package cdienv holds what the mgpu CDI spec puts in a container and the
// hook reads back: the environment keys and the client directory. It
// depends on nothing heavier than the node configuration, so that the hook,
// which runs at every container start, need not load the CDI library.
package cdienv

import (
	"path/filepath"
	"strconv"

	"github.com/mgpu-dev/mgpu/internal/config"
)

// Environment variables the spec sets in containers.
const (
	// RunDir is the run directory; a device's client socket is
	// $MGPU_RUN_DIR/gpuX/client/client.sock.
	RunDir = "MGPU_RUN_DIR"
	// DevicePrefix + X = <uuid> is set for each requested GPU X, one key
	// per GPU so that requesting several devices never overwrites a value.
	DevicePrefix = "MGPU_DEVICE_"
)

// DeviceKey is the per-device environment key of GPU index.
func DeviceKey(index int) string { return DevicePrefix + strconv.Itoa(index) }

// ClientDir is the directory of device index's client socket, mounted
// read-only at the same path. It is the only part of the run directory a
// container sees: never the socket itself (a restarted enforcer makes a new
// one), never control.sock or regions/.
func ClientDir(cfg *config.Config, index int) string {
	return filepath.Join(cfg.DeviceRunDir(index), "client")
}
