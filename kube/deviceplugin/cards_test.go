package deviceplugin

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/kube/placement"
)

// fakeEnforcer answers GET /v1/device on the control socket of GPU index.
func fakeEnforcer(t *testing.T, cfg *config.Config, r api.DeviceResponse) {
	t.Helper()
	dir := cfg.DeviceRunDir(r.Index)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", api.ControlSocket(dir))
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/device", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(r)
	})
	srv := &http.Server{Handler: mux}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
}

func TestEnforcerCards(t *testing.T) {
	t.Parallel()
	cfg := config.Default()
	cfg.RunDir = t.TempDir()
	fakeEnforcer(t, cfg, api.DeviceResponse{
		Index: 1, UUID: "GPU-1", MemoryMiB: 81920, MemoryFreeMiB: 61440,
		Instances: 2, CoreSum: 70, CoreFree: 30, MemoryAllocatedMiB: 20480,
	})
	src := NewEnforcerCards(cfg, []int{0, 1})
	for range 2 { // the second time over the same clients
		cards, err := src.Cards(context.Background())
		want := []placement.Card{{Index: 1, UUID: "GPU-1", MemoryMiB: 81920, MemoryFreeMiB: 61440, CoreFree: 30, Instances: 2}}
		if len(cards) != 1 || cards[0] != want[0] {
			t.Fatalf("cards %+v, want %+v", cards, want)
		}
		if !errors.Is(err, api.ErrNotRunning) || !strings.HasPrefix(err.Error(), "GPU 0: ") {
			t.Fatalf("err %v, want GPU 0's enforcer not running", err)
		}
	}
}
