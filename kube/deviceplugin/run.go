package deviceplugin

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// Timings of the registration.
const (
	registerTimeout = 5 * time.Second
	// A registration that fails (no kubelet yet, or one still starting) is
	// tried again after retryMin, doubling up to retryMax, besides at
	// once when the kubelet's socket appears.
	retryMin = 200 * time.Millisecond
	retryMax = 5 * time.Second
	// restartDelay spaces restarts of a server that failed.
	restartDelay = time.Second
)

// Run serves the plugin until ctx ends: it listens on SocketPath, registers
// with the kubelet, and whenever the kubelet restarts (it then removes the
// plugins' sockets and creates kubelet.sock anew, which Run watches for
// with inotify) it serves on a fresh socket and registers again. The
// socket is removed when Run returns. Errors are those that make serving
// impossible: the directory cannot be watched or the socket not created.
func (p *Plugin) Run(ctx context.Context) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch %s: %w", p.dir, err)
	}
	defer func() { _ = w.Close() }()
	if err := w.Add(p.dir); err != nil {
		return fmt.Errorf("watch %s: %w", p.dir, err)
	}

	ctx, cancel := context.WithCancel(ctx)
	var polling sync.WaitGroup
	defer polling.Wait()
	defer cancel()
	p.poll(ctx)
	polling.Go(func() { p.pollLoop(ctx) })

	for {
		srv, served, err := p.serve()
		if err != nil {
			return err
		}
		again := p.session(ctx, w, served)
		srv.Stop() // closes the listener, which removes the socket
		if !again {
			return nil
		}
	}
}

// serve listens on a fresh socket and serves on it; served receives
// Serve's end.
func (p *Plugin) serve() (*grpc.Server, <-chan error, error) {
	path := p.SocketPath()
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, nil, fmt.Errorf("remove the old socket: %w", err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, nil, err
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	p.log.Info("serving", "socket", path, "resource", p.scheme.Core, "gpus", p.gpus, "placement", p.Policy().String())
	return srv, served, nil
}

// session registers the server that just started and watches for the
// kubelet's restart. It returns whether to serve again (false: ctx ended).
func (p *Plugin) session(ctx context.Context, w *fsnotify.Watcher, served <-chan error) bool {
	registered := false
	delay := retryMin
	retry := time.NewTimer(0) // the first registration
	defer retry.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-retry.C:
			if err := p.register(ctx); err != nil {
				p.log.Warn("not registered with the kubelet; trying again", "err", err, "in", delay)
				retry.Reset(delay)
				delay = min(2*delay, retryMax)
				continue
			}
			registered = true
			p.log.Info("registered with the kubelet", "kubelet", p.KubeletSocketPath(), "resource", p.scheme.Core)
		case err := <-served:
			p.log.Error("the server stopped; serving again", "err", err)
			select {
			case <-ctx.Done():
				return false
			case <-time.After(restartDelay):
			}
			return true
		case ev, ok := <-w.Events:
			if !ok {
				return false
			}
			if ev.Name != p.KubeletSocketPath() || ev.Op&fsnotify.Create == 0 {
				continue
			}
			// A kubelet that starts removes the plugins' sockets before
			// it creates kubelet.sock. If ours is gone, serve on a new
			// one; if it is still there (a kubelet that started after
			// the plugin, or one whose cleanup spared it), registering
			// again is enough, and keeps the connection of a kubelet
			// that already dialled us.
			if !isSocket(p.SocketPath()) {
				p.log.Info("the kubelet restarted; serving on a new socket and registering again", "registered", registered)
				return true
			}
			p.log.Info("the kubelet started; registering again", "registered", registered)
			delay = retryMin
			retry.Reset(0)
		case err, ok := <-w.Errors:
			if !ok {
				return false
			}
			// Events may have been lost (a full queue): start over as
			// if the kubelet had restarted, which is harmless.
			p.log.Warn("watching the device-plugin directory; serving again", "err", err)
			return true
		}
	}
}

// isSocket reports whether path is a Unix socket.
func isSocket(path string) bool {
	fi, err := os.Lstat(path)
	return err == nil && fi.Mode()&os.ModeSocket != 0
}

// register tells the kubelet about the plugin.
func (p *Plugin) register(ctx context.Context) error {
	conn, err := grpc.NewClient("unix://"+p.KubeletSocketPath(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(ctx, registerTimeout)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     p.scheme.Socket,
		ResourceName: string(p.scheme.Core),
		Options:      options(),
	})
	return err
}
