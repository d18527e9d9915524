package e2e

import (
	"context"
	"errors"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/test/fakecuda"
)

// A Docker container with `--device <kind>=all` on a node of two GPUs gets
// an instance on each, with the quota it asked for (as MGPU_* variables and
// as --annotation), sees both GPUs with the quota as their memory, and
// leaves no instance behind when it is removed.
func TestDockerAllGPUs(t *testing.T) {
	e := setup(t, NodeOptions{Devices: 2}, useDocker|useDockerAnnotations)
	ctx := context.Background()
	for _, eng := range e.engines {
		t.Run(eng.Name(), func(t *testing.T) {
			c := e.container("all", "30", "1024", "/bin/sleep", "3600")
			c.Devices = []string{"all"}
			if out, err := eng.Start(ctx, c); err != nil {
				t.Fatalf("start: %v\n%s", err, out)
			}
			e.waitInstances(t, 2, 5*time.Second)
			devs := map[int]bool{}
			for _, in := range e.instances(t) {
				devs[in.Device] = true
				if in.Core != 30 || in.MemoryMiB != 1024 {
					t.Errorf("instance %s: core %d, memory %d MiB; want 30 and 1024", in.Name, in.Core, in.MemoryMiB)
				}
			}
			if !devs[0] || !devs[1] {
				t.Errorf("instances on devices %v, want 0 and 1", devs)
			}
			out, err := eng.Exec(ctx, c.ID, "/bin/mgpu-workload", "info")
			if err != nil {
				t.Fatalf("mgpu-workload info: %v\n%s", err, out)
			}
			f := fakecuda.Fields(out)
			if f["device_count"] != "2" {
				t.Errorf("device_count=%q, want 2:\n%s", f["device_count"], out)
			}
			for _, d := range []string{"0", "1"} {
				if got := f["device."+d+".total_mem"]; got != strconv.Itoa(1024<<20) {
					t.Errorf("device %s: total_mem=%q, want the quota %d", d, got, 1024<<20)
				}
			}
			if err := eng.Remove(ctx, c.ID); err != nil {
				t.Fatal(err)
			}
			e.waitInstances(t, 0, 2*time.Second)
		})
	}
}

// A container the hook refuses leaves nothing behind: `docker run` exits
// non-zero with the hook's mgpu: line, no instance is left, and Docker
// keeps no container record of it.
func TestDockerRefusalLeavesNothing(t *testing.T) {
	e := setup(t, NodeOptions{MemoryMiB: 16384}, useDocker)
	eng, ctx := e.engines[0].(*Docker), context.Background()
	c := e.container("refused", "30", "16385", "/bin/sh", "-c", "echo container-ran")
	out, err := eng.Run(ctx, c)
	want := "mgpu: device 0 has 16384 MiB memory free (0 of 16384 MiB allocated), container asks 16385 MiB"
	if err == nil || strings.Contains(out, "container-ran") || !strings.Contains(out, want) {
		t.Fatalf("docker run: err %v, want a refusal with %q:\n%s", err, want, out)
	}
	code := -1
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	}
	t.Logf("docker run exited %d: %s", code, lineWith(out, want))
	e.waitInstances(t, 0, 2*time.Second)
	ps, err := eng.E.DockerStdout(ctx, 30*time.Second, "ps", "-a", "--format", "{{.Names}} {{.Status}}")
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(ps) != "" {
		t.Errorf("docker keeps containers after the refusal:\n%s", ps)
	}
}
