// Command mgpu-cli is the operator's tool: device info, node labels, CDI
// specs, engine configuration, instances.
package main

import (
	"os"

	"github.com/mgpu-dev/mgpu/internal/cli"
)

func main() {
	os.Exit(cli.Main(os.Args, os.Stdout, os.Stderr))
}
