package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"syscall"
	"time"

	"github.com/mgpu-dev/mgpu/internal/unixhttp"
)

// Client talks to one device's enforcer over its control socket, one
// connection per request (package unixhttp: no net/http in mgpu-hook).
type Client struct {
	socket string
}

// DefaultTimeout bounds one request of a Client.
const DefaultTimeout = 10 * time.Second

// NewClient returns a client of the control socket at path (see
// ControlSocket).
func NewClient(socket string) *Client {
	return &Client{socket: socket}
}

// ErrNotRunning is returned (wrapped) when nothing listens on the socket.
var ErrNotRunning = errors.New("enforcer is not running")

// Error is an answer of the enforcer with a 4xx/5xx status; its text is the
// enforcer's one-line message.
type Error struct {
	Status  int
	Message string
}

func (e *Error) Error() string { return e.Message }

// Create asks for an instance (POST /v1/instances).
func (c *Client) Create(ctx context.Context, req CreateRequest) (CreateResponse, error) {
	var out CreateResponse
	err := c.do(ctx, "POST", "/v1/instances", req, &out)
	return out, err
}

// Destroy releases the instance with the given name; Released is false when
// it did not exist.
func (c *Client) Destroy(ctx context.Context, name string) (DestroyResponse, error) {
	var out DestroyResponse
	err := c.do(ctx, "DELETE", "/v1/instances/"+url.PathEscape(name), nil, &out)
	return out, err
}

// DestroyContainer releases the instance of a container id.
func (c *Client) DestroyContainer(ctx context.Context, containerID string) (DestroyResponse, error) {
	var out DestroyResponse
	err := c.do(ctx, "DELETE", "/v1/instances?container_id="+url.QueryEscape(containerID), nil, &out)
	return out, err
}

// Get returns one instance.
func (c *Client) Get(ctx context.Context, name string) (Instance, error) {
	var out Instance
	err := c.do(ctx, "GET", "/v1/instances/"+url.PathEscape(name), nil, &out)
	return out, err
}

// List returns the device's instances, ordered by id.
func (c *Client) List(ctx context.Context) ([]Instance, error) {
	var out ListResponse
	err := c.do(ctx, "GET", "/v1/instances", nil, &out)
	return out.Instances, err
}

// Device returns the device's live allocation.
func (c *Client) Device(ctx context.Context) (DeviceResponse, error) {
	var out DeviceResponse
	err := c.do(ctx, "GET", "/v1/device", nil, &out)
	return out, err
}

// Stats returns the accounting of every instance.
func (c *Client) Stats(ctx context.Context) ([]InstanceStats, error) {
	var out StatsResponse
	err := c.do(ctx, "GET", "/v1/stats", nil, &out)
	return out.Instances, err
}

// maxResponseBytes bounds what the client reads of an answer.
const maxResponseBytes = 16 << 20

func (c *Client) do(ctx context.Context, method, p string, body, out any) error {
	var b []byte
	if body != nil {
		var err error
		if b, err = json.Marshal(body); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, DefaultTimeout)
	defer cancel()
	resp, err := unixhttp.Do(ctx, c.socket, method, p, b, maxResponseBytes)
	if err != nil {
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			return fmt.Errorf("%w (no one listens on %s)", ErrNotRunning, c.socket)
		}
		return fmt.Errorf("enforcer at %s: %w", c.socket, err)
	}
	data := resp.Body
	if resp.StatusCode >= 400 {
		var e ErrorResponse
		if json.Unmarshal(data, &e) == nil && e.Error != "" {
			return &Error{Status: resp.StatusCode, Message: e.Error}
		}
		return &Error{Status: resp.StatusCode, Message: fmt.Sprintf("enforcer answered %s: %s", resp.Status, strings.TrimSpace(string(data)))}
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("enforcer at %s: bad answer: %w", c.socket, err)
	}
	return nil
}
