// Command kubectl-inspect-mgpu is the kubectl plugin behind `kubectl
// inspect mgpu`: the GPU memory allocation of the cluster's nodes, the same
// as `mgpu-cli inspect --cluster` (logic in internal/cli).
package main

import (
	"os"

	"github.com/mgpu-dev/mgpu/internal/cli"
)

func main() {
	os.Exit(cli.KubectlInspect(os.Args, os.Stdout, os.Stderr))
}
