package tenants

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/test/harness"
)

// floodSocket is a tenant's denial of service on the attach server: n
// connections that never write a byte, each reopened as soon as the
// enforcer drops it, until killed.
func floodSocket(n int) int {
	sock := filepath.Join(os.Getenv("MGPU_RUN_DIR"), "gpu0", "client", "client.sock")
	opened := make(chan struct{}, n)
	for range n {
		go func() {
			first := true
			for {
				c, err := net.Dial("unix", sock)
				if err != nil {
					time.Sleep(time.Millisecond) // backlog full: the flood's own pace
					continue
				}
				if first {
					opened <- struct{}{}
					first = false
				}
				_, _ = io.Copy(io.Discard, c)
				_ = c.Close()
			}
		}()
	}
	for range n {
		<-opened
	}
	fmt.Printf("flooding %d\n", n)
	select {}
}

// TestAttachFlood: a process of one instance holds 1,024 silent
// connections to the client socket and reopens every one the enforcer
// drops. A CUDA process of a neighbour instance still attaches within 1 s
// (measured from its start to its first successful CUDA call, beside the
// same without the flood), and the control API answers.
func TestAttachFlood(t *testing.T) {
	var logs harness.SyncBuffer
	n := newNode(t, harness.NodeConfig{Log: &logs})
	nb, err := n.Shell(0, 50, 2048)
	if err != nil {
		t.Fatal(err)
	}
	attachTime := func() time.Duration {
		t.Helper()
		t0 := time.Now()
		p, err := nb.Spawn("alloc", "--api", "cuMemAlloc_v2", "--mib", "1", "--hold-ms", "0")
		if err != nil {
			t.Fatal(err)
		}
		if err := p.WaitOutput("-> CUDA_SUCCESS", 15*time.Second); err != nil {
			t.Fatalf("neighbour: %v\n%s\nenforcer log:\n%s", err, p.Output(), logs.String())
		}
		return time.Since(t0)
	}
	alone := attachTime()
	fl, err := n.Shell(0, 20, 1024)
	if err != nil {
		t.Fatal(err)
	}
	defer fl.Close()
	p, err := fl.SpawnCommand(self(roleFlood)...)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.WaitOutput("flooding 1024", 30*time.Second); err != nil {
		t.Fatalf("flood: %v\n%s", err, p.Output())
	}
	beside := attachTime()
	t0 := time.Now()
	if _, err := n.Client(0).List(context.Background()); err != nil {
		t.Fatalf("control API during the flood: %v", err)
	}
	listed := time.Since(t0)
	t.Logf("neighbour's first CUDA call: %v alone, %v beside 1,024 silent connections; control API list %v", alone, beside, listed)
	fmt.Printf("BENCH tenants_attach_alone %.1f ms\nBENCH tenants_attach_flood %.1f ms\n", ms(alone), ms(beside))
	if beside > time.Second || listed > time.Second {
		t.Fatalf("during a flood from another instance: attach %v, control API %v, want both within 1s", beside, listed)
	}
	if !strings.Contains(logs.String(), "attach connections over their budget refused") {
		t.Errorf("the flood was not logged:\n%s", logs.String())
	}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
