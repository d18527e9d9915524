package deviceplugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/mgpu-dev/mgpu/kube/agentapi"
)

// resolveTimeout bounds one answer of the agent (a pod read and a
// PodResources list), inside the hook's own 5 s.
const resolveTimeout = 4 * time.Second

// AgentHandler serves agentapi's queries with r.
func AgentHandler(r *Resolver, log *slog.Logger) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+agentapi.AssignmentPath, func(w http.ResponseWriter, req *http.Request) {
		q := req.URL.Query()
		c := agentapi.Container{Namespace: q.Get("namespace"), Pod: q.Get("pod"), UID: q.Get("uid"), Container: q.Get("container")}
		ctx, cancel := context.WithTimeout(req.Context(), resolveTimeout)
		defer cancel()
		a, err := r.Resolve(ctx, c)
		w.Header().Set("Content-Type", "application/json")
		if err != nil {
			log.Warn("refused", "namespace", c.Namespace, "pod", c.Pod, "container", c.Container, "err", err)
			w.WriteHeader(http.StatusForbidden)
			_ = json.NewEncoder(w).Encode(agentapi.Error{Message: err.Error()})
			return
		}
		log.Info("assigned", "namespace", c.Namespace, "pod", c.Pod, "container", c.Container, "policy", a.Policy, "gpus", a.GPUs)
		_ = json.NewEncoder(w).Encode(a)
	})
	return mux
}

// ServeAgent serves r on the Unix socket path (mode 0600: only root, the
// hook, asks) until ctx ends, and removes the socket then. A stale socket
// of an earlier run is replaced.
func ServeAgent(ctx context.Context, path string, r *Resolver, log *slog.Logger) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("the agent's socket: %w", err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("the agent's socket: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		_ = l.Close()
		return fmt.Errorf("the agent's socket: %w", err)
	}
	srv := &http.Server{Handler: AgentHandler(r, log), ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	log.Info("node agent serving", "socket", path)
	select {
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
		return nil
	case err := <-served:
		return fmt.Errorf("the agent's socket: %w", err)
	}
}
