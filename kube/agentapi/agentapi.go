// Package agentapi is the node agent's local API: mgpu-device-plugin
// answers, on a Unix socket of the node's run_dir, which quota a Kubernetes
// container has, from its own pod's spec and the kubelet's allocation;
// mgpu-hook asks it for every container the CRI names as a pod's. The
// package holds the types and the client, and no Kubernetes dependency, so
// that the hook stays small.
package agentapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"path/filepath"
	"syscall"
	"time"

	"github.com/mgpu-dev/mgpu/internal/unixhttp"
)

// SocketName is the agent's socket in the node's run_dir.
const SocketName = "kube-agent.sock"

// Socket is the agent's socket of a node whose run_dir is runDir.
func Socket(runDir string) string { return filepath.Join(runDir, SocketName) }

// AssignmentPath is the path of the assignment query: GET AssignmentPath?namespace=&pod=&uid=&container=.
const AssignmentPath = "/v1/assignment"

// Container names one container of one pod, as the CRI annotations of its
// OCI spec do (io.kubernetes.cri.sandbox-namespace, -name, -uid and
// io.kubernetes.cri.container-name).
type Container struct {
	Namespace string `json:"namespace"`
	Pod       string `json:"pod"`
	UID       string `json:"uid"`
	Container string `json:"container"`
}

func (c Container) String() string {
	return fmt.Sprintf("container %q of pod %s/%s", c.Container, c.Namespace, c.Pod)
}

// GPU is the share of one GPU a container was given.
type GPU struct {
	Index int `json:"index"`
	// Core is the compute quota on this GPU, 1..100.
	Core int `json:"core"`
	// MemoryMiB is the memory quota on this GPU; 0 means the whole card
	// (a whole-GPU request without mgpu-memory).
	MemoryMiB uint64 `json:"memory_mib"`
	// Claim is the ResourceClaim whose share this is (node mode dra);
	// "" for the device plugins' allocations.
	Claim string `json:"claim,omitempty"`
}

// Assignment is what a container may have: its pod's requests and the
// GPUs the kubelet allocated to it.
type Assignment struct {
	Container
	// Policy is the pod's compute policy (its annotation, else fixed-share).
	Policy string `json:"policy"`
	// Class is the pod's priority class (its annotation
	// vke.volcengine.com/mgpu-class), "online" or "offline"; "" online.
	Class string `json:"class,omitempty"`
	// GPUs, by index.
	GPUs []GPU `json:"gpus"`
}

// Error is the agent's answer to a query it refuses; Message is one line.
type Error struct {
	Status  int    `json:"-"`
	Message string `json:"error"`
}

func (e *Error) Error() string { return e.Message }

// ErrNotRunning is returned (wrapped) when nothing listens on the socket.
var ErrNotRunning = errors.New("the mgpu node agent (mgpu-device-plugin) is not running")

// Client asks the agent on one socket, one connection per query (package
// unixhttp: no net/http in mgpu-hook).
type Client struct {
	socket string
}

// DefaultTimeout bounds one query.
const DefaultTimeout = 5 * time.Second

// NewClient returns a client of the agent's socket.
func NewClient(socket string) *Client {
	return &Client{socket: socket}
}

// maxAnswer bounds an answer's size.
const maxAnswer = 1 << 20

// Assignment asks what container c may have.
func (c *Client) Assignment(ctx context.Context, ctr Container) (Assignment, error) {
	q := url.Values{"namespace": {ctr.Namespace}, "pod": {ctr.Pod}, "uid": {ctr.UID}, "container": {ctr.Container}}
	ctx, cancel := context.WithTimeout(ctx, DefaultTimeout)
	defer cancel()
	resp, err := unixhttp.Do(ctx, c.socket, "GET", AssignmentPath+"?"+q.Encode(), nil, maxAnswer)
	if err != nil {
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			return Assignment{}, fmt.Errorf("%w (no one answers on %s)", ErrNotRunning, c.socket)
		}
		return Assignment{}, fmt.Errorf("the mgpu node agent on %s: %w", c.socket, err)
	}
	body := resp.Body
	if resp.StatusCode != 200 {
		e := &Error{Status: resp.StatusCode}
		if json.Unmarshal(body, e) != nil || e.Message == "" {
			e.Message = fmt.Sprintf("the mgpu node agent answered %s", resp.Status)
		}
		return Assignment{}, e
	}
	var a Assignment
	if err := json.Unmarshal(body, &a); err != nil {
		return Assignment{}, fmt.Errorf("the mgpu node agent on %s: bad answer: %w", c.socket, err)
	}
	if a.Container != ctr {
		return Assignment{}, fmt.Errorf("the mgpu node agent on %s answered for %s, not %s", c.socket, a.Container, ctr)
	}
	return a, nil
}
