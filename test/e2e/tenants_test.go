package e2e

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// TestContainerBypass: a process in a container loads the driver into a
// link-map namespace of its own (dlmopen), where the preloaded shim is not,
// and allocates 4 GiB in a 1 GiB instance. The enforcer's driver backstop
// (NVML's per-process memory, the host pid attributed to the container)
// kills it within 2 s. (The tamper case runs in TestContainerIsolation.)
func TestContainerBypass(t *testing.T) {
	e := setup(t, NodeOptions{}, useCtr)
	ctx := context.Background()
	for _, eng := range e.engines {
		t.Run(eng.Name(), func(t *testing.T) {
			c := e.container("bypass", "20", "1024")
			c.Args = sh(c.ID, "exec /bin/mgpu-workload --resolve dlmopen alloc --api cuMemAlloc_v2 --mib 4096 --hold-ms -1")
			if out, err := eng.Start(ctx, c); err != nil {
				t.Fatalf("start: %v\n%s", err, out)
			}
			defer func() { _ = eng.Remove(ctx, c.ID) }()
			// Its process is the container's init: once it is killed, the
			// task stops.
			pid, _ := eng.InitPID(ctx, c.ID)
			e.waitOutput(t, c.ID, "-> CUDA_SUCCESS", 20*time.Second)
			t0 := time.Now()
			if err := Poll(10*time.Second, func() error {
				if _, err := eng.InitPID(ctx, c.ID); err == nil && pid > 0 && alive(pid) {
					return fmt.Errorf("pid %d (4096 MiB in a 1024 MiB container) still runs", pid)
				}
				return nil
			}); err != nil {
				t.Fatalf("%v\n%s", err, e.output(c.ID))
			}
			took := time.Since(t0)
			t.Logf("the container's bypass (4096 MiB of 1024) was killed %v after its allocation", took.Round(time.Millisecond))
			if took > 2*time.Second {
				t.Errorf("killed after %v, want within 2s", took)
			}
		})
	}
}

// TestSharedPidNamespace: a second container that joins the pid namespace
// of a running mgpu container (podman --pid ns:, ctr --with-ns pid:, as
// Kubernetes' shareProcessNamespace does) is refused when it is created,
// with one line that names the first container, and is never merged into
// the first container's instance; the first keeps running and keeps its
// instance.
func TestSharedPidNamespace(t *testing.T) {
	e := setup(t, NodeOptions{}, useCtr|usePodman)
	ctx := context.Background()
	for _, eng := range e.engines {
		t.Run(eng.Name(), func(t *testing.T) {
			first := e.container("pidns-app", "20", "512")
			first.Args = sh(first.ID, "exec sleep 300")
			if out, err := eng.Start(ctx, first); err != nil {
				t.Fatalf("start: %v\n%s", err, out)
			}
			defer func() { _ = eng.Remove(ctx, first.ID) }()
			e.waitInstances(t, 1, 20*time.Second)
			before := e.instances(t)[0]
			pid, err := eng.InitPID(ctx, first.ID)
			if err != nil {
				t.Fatal(err)
			}
			second := e.container("pidns-sidecar", "20", "512")
			second.Args = sh(second.ID, "exec sleep 300")
			second.JoinPID = pid
			out, err := eng.Start(ctx, second)
			defer func() { _ = eng.Remove(ctx, second.ID) }()
			// The engine's own id of the first container (podman's is not
			// its name).
			want := "shares its pid namespace with container " + before.ContainerID
			if err == nil {
				t.Fatalf("the second container in %s's pid namespace started:\n%s", first.ID, out)
			}
			if !strings.Contains(out, want) {
				t.Fatalf("refusal %v:\n%s\nwant a line with %q", err, out, want)
			}
			t.Logf("refused: %s", lineWith(out, want))
			list := e.instances(t)
			if len(list) != 1 || list[0].Name != before.Name || list[0].ContainerID != before.ContainerID {
				t.Fatalf("instances %+v, want only %s's (%s)", list, first.ID, before.Name)
			}
			if _, err := eng.InitPID(ctx, first.ID); err != nil {
				t.Fatalf("the first container stopped: %v", err)
			}
		})
	}
}

// alive reports whether pid runs (and is not a zombie).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] != 'Z'
}
