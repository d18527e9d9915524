// Package dranames holds the names of mgpu's DRA driver (package
// kube/dra): its driver and DeviceClass, and its devices' capacities,
// attributes and taint. The webhook (which writes claims of them) and
// mgpu-cli (which reads them) use it without linking the driver's kubelet
// plugin and its gRPC.
package dranames

import (
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
)

// Driver is the driver's name: the ResourceSlices' and DeviceClass's
// driver, and the domain of its attributes and capacities.
const Driver = "gpu.mgpu.io"

// DeviceClass is the DeviceClass the chart ships.
const DeviceClass = "gpu.mgpu.io"

// The devices' capacities (consumable) and attributes.
const (
	CapCores     resourceapi.QualifiedName = "cores"
	CapMemory    resourceapi.QualifiedName = "memory"
	CapInstances resourceapi.QualifiedName = "instances"

	AttrIndex     resourceapi.QualifiedName = "index"
	AttrUUID      resourceapi.QualifiedName = "uuid"
	AttrModel     resourceapi.QualifiedName = "model"
	AttrMemoryMiB resourceapi.QualifiedName = "memoryMiB"
	AttrPolicy    resourceapi.QualifiedName = "policy"
	AttrSwitch    resourceapi.QualifiedName = "onlineOfflineSwitch"
)

// TaintEnforcerDown is the device taint of a GPU whose enforcer does not
// answer: no new claim is placed on it (NoSchedule); claims it holds stay.
const TaintEnforcerDown = Driver + "/enforcer-down"

// DeviceName is the ResourceSlice device of GPU index, gpu-<index>.
func DeviceName(index int) string { return "gpu-" + strconv.Itoa(index) }

// ParseDeviceName is DeviceName's inverse: the GPU index of a device name
// (ok false for any other string, e.g. gpu-01 or gpu--1).
func ParseDeviceName(s string) (int, bool) {
	v, ok := strings.CutPrefix(s, "gpu-")
	if !ok {
		return 0, false
	}
	i, err := strconv.Atoi(v)
	if err != nil || i < 0 || strconv.Itoa(i) != v {
		return 0, false
	}
	return i, true
}
