// Command mgpu-hook is mgpu's OCI hook, run by the container runtime from
// the hooks of the mgpu CDI spec: "create" (createRuntime) admits the
// container's GPU shares with each device's enforcer, "destroy" (poststop)
// releases them. See docs/hook.md.
package main

import (
	"os"

	"github.com/mgpu-dev/mgpu/hook"
)

func main() {
	os.Exit(hook.Main(os.Args, os.Stdin, os.Stdout, os.Stderr))
}
