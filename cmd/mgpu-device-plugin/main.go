// Command mgpu-device-plugin is mgpu's kubelet device plugin: it serves the
// resource vke.volcengine.com/mgpu-core, 100 device IDs per GPU
// (mgpu-<gpu>-<00..99>), and answers Allocate with the GPU's CDI device
// and MGPU_CORE. See docs/kubernetes.md.
//
//	mgpu-device-plugin [--config FILE] [--device-plugin-dir DIR] [--placement binpack|spread]
package main

import (
	"os"

	"github.com/mgpu-dev/mgpu/kube/deviceplugin"
)

func main() {
	os.Exit(deviceplugin.Command(os.Args[1:], os.Stdout, os.Stderr))
}
