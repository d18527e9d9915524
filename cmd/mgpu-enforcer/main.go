// Command mgpu-enforcer is the per-device daemon of mgpu: it admits
// instances, hands their regions to the processes of each container, and
// arbitrates GPU time between them (systemd unit mgpu-enforcer@X).
//
//	mgpu-enforcer --device X [--config FILE] [--log-level LEVEL] [--log-format text|json]
package main

import (
	"os"

	"github.com/mgpu-dev/mgpu/enforcer"
)

func main() {
	os.Exit(enforcer.Command(os.Args[1:], os.Stderr))
}
