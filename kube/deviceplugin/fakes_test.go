package deviceplugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/mgpu-dev/mgpu/kube/placement"
)

// waitFor bounds every wait of these tests.
const waitFor = 10 * time.Second

// fakeCards is a CardSource whose answering GPUs the test sets.
type fakeCards struct {
	mu    sync.Mutex
	cards []placement.Card
}

func newFakeCards(gpus ...int) *fakeCards {
	f := &fakeCards{}
	f.set(gpus...)
	return f
}

// set makes GPUs gpus (and only those) answer.
func (f *fakeCards) set(gpus ...int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cards = nil
	for _, g := range gpus {
		f.cards = append(f.cards, placement.Card{Index: g, MemoryMiB: 81920, MemoryFreeMiB: 81920, CoreFree: 100})
	}
}

func (f *fakeCards) Cards(context.Context) ([]placement.Card, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]placement.Card(nil), f.cards...), errors.New("some enforcers do not answer (fake)")
}

// registration is one Register call the fake kubelet received, with a
// client of the endpoint it names.
type registration struct {
	req    *pluginapi.RegisterRequest
	client pluginapi.DevicePluginClient
}

// fakeKubelet is the kubelet's registration service on kubelet.sock of a
// directory. Like the kubelet, it dials the endpoint a plugin registers.
type fakeKubelet struct {
	pluginapi.UnimplementedRegistrationServer
	dir  string
	srv  *grpc.Server
	regs chan registration

	mu    sync.Mutex
	conns []*grpc.ClientConn // to the plugins that registered
}

func startKubelet(t *testing.T, dir string) *fakeKubelet {
	t.Helper()
	k := &fakeKubelet{dir: dir, srv: grpc.NewServer(), regs: make(chan registration, 16)}
	l, err := net.Listen("unix", filepath.Join(dir, KubeletSocketName))
	if err != nil {
		t.Fatal(err)
	}
	pluginapi.RegisterRegistrationServer(k.srv, k)
	go func() { _ = k.srv.Serve(l) }()
	t.Cleanup(k.stop)
	return k
}

// stop stops the kubelet, which removes kubelet.sock.
func (k *fakeKubelet) stop() {
	k.srv.Stop()
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, c := range k.conns {
		_ = c.Close()
	}
	k.conns = nil
}

func (k *fakeKubelet) Register(_ context.Context, r *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	if r.GetVersion() != pluginapi.Version {
		return nil, fmt.Errorf("unsupported version %q", r.GetVersion())
	}
	conn, err := grpc.NewClient("unix://"+filepath.Join(k.dir, r.GetEndpoint()), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	k.mu.Lock()
	k.conns = append(k.conns, conn)
	k.mu.Unlock()
	k.regs <- registration{req: r, client: pluginapi.NewDevicePluginClient(conn)}
	return &pluginapi.Empty{}, nil
}

// next waits for the next registration.
func (k *fakeKubelet) next(t *testing.T) registration {
	t.Helper()
	select {
	case r := <-k.regs:
		return r
	case <-time.After(waitFor):
		t.Fatalf("no registration within %v", waitFor)
		return registration{}
	}
}

// testLogger discards the plugin's logs unless -v.
func testLogger() *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// startPlugin runs a plugin of gpus in dir until the test ends, then
// checks that Run returned and removed its socket.
func startPlugin(t *testing.T, dir string, gpus []int, src CardSource, opts ...Option) *Plugin {
	t.Helper()
	opts = append([]Option{WithDir(dir), WithPollInterval(10 * time.Millisecond), WithLogger(testLogger())}, opts...)
	p, err := New(gpus, src, opts...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(waitFor):
			t.Errorf("Run did not return within %v of its context's end", waitFor)
			return
		}
		if _, err := os.Stat(p.SocketPath()); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the socket is left after Run: %v", err)
		}
	})
	return p
}

// eventually polls cond until it holds or waitFor passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, waitFor)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
