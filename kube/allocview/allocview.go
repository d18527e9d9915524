// Package allocview is the allocation of a node's GPU memory as mgpu shows
// it (`mgpu-cli inspect`, in the form of ACK's `kubectl inspect cgpu`):
// per GPU, the memory its enforcer has allocated to instances over the
// GPU's memory. Collect builds a node's view from its enforcers; the node
// agent publishes it on the Node as Annotation (Encode), and
// `mgpu-cli inspect --cluster` reads it back from every node (Decode).
package allocview

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
)

// Annotation is the Node annotation whose value is a Node, as Encode
// writes it.
const Annotation = "mgpu.io/gpu-allocation"

// Limits of an annotation's value that Decode accepts.
const (
	MaxSize    = 64 << 10 // bytes
	MaxGPUs    = 64
	MaxUUIDLen = 128
	// MaxMiB bounds a GPU's memory (4 PiB): the sums over a cluster's
	// GPUs cannot overflow.
	MaxMiB = 1 << 32
)

// GPU is one GPU's allocation.
type GPU struct {
	Index        int    `json:"index"` // NVML index
	UUID         string `json:"uuid,omitempty"`
	AllocatedMiB uint64 `json:"allocated_mib"` // Σ the memory quotas of its instances; 0 when not Running
	TotalMiB     uint64 `json:"total_mib"`     // the GPU's memory
	Instances    int    `json:"instances"`     // 0 when not Running
	Running      bool   `json:"running"`       // whether its enforcer answered
}

// Node is a node's allocation: its GPUs, by index, at Updated.
type Node struct {
	GPUs    []GPU     `json:"gpus"`
	Updated time.Time `json:"updated"`
}

// ErrInvalid is returned (wrapped) by Decode and Encode for a value that
// breaks the format.
var ErrInvalid = errors.New("invalid GPU allocation")

// maxDetail bounds the part of an error that quotes the value.
const maxDetail = 160

func invalid(format string, a ...any) error {
	detail := strings.Map(func(r rune) rune {
		if r != ' ' && (!unicode.IsPrint(r) || unicode.IsSpace(r)) {
			return '?'
		}
		return r
	}, fmt.Sprintf(format, a...))
	if len(detail) > maxDetail {
		cut := maxDetail
		for cut > 0 && !utf8.RuneStart(detail[cut]) {
			cut--
		}
		detail = detail[:cut] + "..."
	}
	return fmt.Errorf("%w: %s", ErrInvalid, detail)
}

// validate checks n as Decode would accept it.
func validate(n Node) error {
	if n.Updated.IsZero() {
		return invalid("no updated time")
	}
	if y := n.Updated.UTC().Year(); y < 1970 || y > 9999 {
		return invalid("updated time %s is out of range", n.Updated.Format(time.RFC3339))
	}
	if len(n.GPUs) > MaxGPUs {
		return invalid("%d GPUs, at most %d", len(n.GPUs), MaxGPUs)
	}
	seen := make(map[int]bool, len(n.GPUs))
	for _, g := range n.GPUs {
		switch {
		case g.Index < 0:
			return invalid("GPU index %d is negative", g.Index)
		case seen[g.Index]:
			return invalid("GPU %d appears twice", g.Index)
		case len(g.UUID) > MaxUUIDLen:
			return invalid("GPU %d: uuid of %d bytes, at most %d", g.Index, len(g.UUID), MaxUUIDLen)
		case !printable(g.UUID):
			return invalid("GPU %d: uuid %q has characters other than printable ones", g.Index, g.UUID)
		case g.TotalMiB > MaxMiB:
			return invalid("GPU %d: total_mib %d is over %d", g.Index, g.TotalMiB, uint64(MaxMiB))
		case g.AllocatedMiB > g.TotalMiB:
			return invalid("GPU %d: allocated_mib %d is over total_mib %d", g.Index, g.AllocatedMiB, g.TotalMiB)
		case g.Instances < 0:
			return invalid("GPU %d: instances %d is negative", g.Index, g.Instances)
		case !g.Running && (g.AllocatedMiB != 0 || g.Instances != 0):
			return invalid("GPU %d: not running but allocated_mib %d and instances %d (want 0)", g.Index, g.AllocatedMiB, g.Instances)
		}
		seen[g.Index] = true
	}
	return nil
}

// printable reports whether s is valid UTF-8 of printable characters
// without spaces.
func printable(s string) bool {
	for _, r := range s {
		if r == utf8.RuneError || !unicode.IsPrint(r) || unicode.IsSpace(r) {
			return false
		}
	}
	return true
}

// Encode returns the annotation's value of n: compact JSON, its GPUs sorted
// by index and its time in UTC, so that equal nodes encode alike. It fails
// for a node that Decode would refuse.
func Encode(n Node) (string, error) {
	n.GPUs = slices.SortedFunc(slices.Values(n.GPUs), func(a, b GPU) int { return cmp.Compare(a.Index, b.Index) })
	if n.GPUs == nil {
		n.GPUs = []GPU{}
	}
	n.Updated = n.Updated.UTC()
	if err := validate(n); err != nil {
		return "", err
	}
	b, err := json.Marshal(n)
	if err != nil {
		return "", fmt.Errorf("encoding the GPU allocation: %w", err)
	}
	if len(b) > MaxSize {
		return "", invalid("%d bytes, at most %d", len(b), MaxSize)
	}
	return string(b), nil
}

// Decode parses an annotation's value, which anyone who may update the
// Node could have written: at most MaxSize bytes of one JSON object with
// exactly Node's fields, at most MaxGPUs GPUs of distinct indexes >= 0, none
// with more allocated than total memory. The GPUs come back sorted by
// index. Errors are one line, wrap ErrInvalid and quote at most a few
// characters of the value.
func Decode(s string) (Node, error) {
	if len(s) > MaxSize {
		return Node{}, invalid("%d bytes, at most %d", len(s), MaxSize)
	}
	dec := json.NewDecoder(bytes.NewReader([]byte(s)))
	dec.DisallowUnknownFields()
	var n Node
	if err := dec.Decode(&n); err != nil {
		return Node{}, invalid("%v", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return Node{}, invalid("data after the JSON object")
	}
	if err := exactKeys(s); err != nil {
		return Node{}, invalid("%v", err)
	}
	if err := validate(n); err != nil {
		return Node{}, err
	}
	if n.GPUs == nil {
		n.GPUs = []GPU{}
	}
	slices.SortFunc(n.GPUs, func(a, b GPU) int { return cmp.Compare(a.Index, b.Index) })
	return n, nil
}

// The keys of Node's and GPU's objects.
var (
	nodeKeys = []string{"gpus", "updated"}
	gpuKeys  = []string{"index", "uuid", "allocated_mib", "total_mib", "instances", "running"}
)

// exactKeys checks the keys of s, a Node's JSON that decodes: encoding/json
// matches keys regardless of case and lets the last of duplicates win, so
// this walk refuses a key not spelled as Node's and GPU's tags and a key
// given twice.
func exactKeys(s string) error {
	dec := json.NewDecoder(bytes.NewReader([]byte(s)))
	skip := func(string) error {
		var v json.RawMessage
		return dec.Decode(&v)
	}
	return object(dec, nodeKeys, func(key string) error {
		if key != "gpus" {
			return skip(key)
		}
		t, err := dec.Token()
		if err != nil || t == nil { // null
			return err
		}
		for dec.More() {
			if err := object(dec, gpuKeys, skip); err != nil {
				return err
			}
		}
		_, err = dec.Token() // ]
		return err
	})
}

// object reads one object of dec whose keys are among keys, each once,
// calling value to read each key's value.
func object(dec *json.Decoder, keys []string, value func(key string) error) error {
	t, err := dec.Token()
	if err != nil {
		return err
	}
	if t != json.Delim('{') {
		return errors.New("want an object")
	}
	seen := make(map[string]bool, len(keys))
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return err
		}
		key, _ := t.(string)
		switch {
		case !slices.Contains(keys, key):
			return fmt.Errorf("unknown field %q", key)
		case seen[key]:
			return fmt.Errorf("field %q appears twice", key)
		}
		seen[key] = true
		if err := value(key); err != nil {
			return err
		}
	}
	_, err = dec.Token() // }
	return err
}

// Source is what allocview asks of a device's enforcer (*api.Client
// answers it).
type Source interface {
	Device(ctx context.Context) (api.DeviceResponse, error)
}

// Reading is what one device's enforcer answered, or Err when it did not.
type Reading struct {
	Info   device.Info
	Device api.DeviceResponse // empty when Err is set
	Err    error
}

// ReadDevice asks src, device d's enforcer, within ctx.
func ReadDevice(ctx context.Context, d device.Info, src Source) Reading {
	r, err := src.Device(ctx)
	if err != nil {
		return Reading{Info: d, Err: err}
	}
	return Reading{Info: d, Device: r}
}

// GPU is the reading's GPU: its memory as the device lists it, and when the
// enforcer answered, what it has allocated; otherwise nothing allocated.
func (r Reading) GPU() GPU {
	g := GPU{Index: r.Info.Index, UUID: r.Info.UUID, TotalMiB: r.Info.MemoryMiB(), Running: r.Err == nil}
	if g.Running {
		g.AllocatedMiB = r.Device.MemoryAllocatedMiB
		g.Instances = r.Device.Instances
	}
	return g
}

// Timeout bounds Read's question to one enforcer.
const Timeout = 5 * time.Second

// Read asks the enforcer of every device of devs (srcs, in the same order)
// at once, each within Timeout, and returns their readings in that order.
func Read(ctx context.Context, devs []device.Info, srcs []Source) []Reading {
	rs := make([]Reading, len(devs))
	var wg sync.WaitGroup
	for i, d := range devs {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(ctx, Timeout)
			defer cancel()
			rs[i] = ReadDevice(ctx, d, srcs[i])
		})
	}
	wg.Wait()
	return rs
}

// NewNode is the node of readings rs taken at at.
func NewNode(rs []Reading, at time.Time) Node {
	n := Node{GPUs: make([]GPU, 0, len(rs)), Updated: at}
	for _, r := range rs {
		n.GPUs = append(n.GPUs, r.GPU())
	}
	return n
}

// Collect asks the enforcer of every device of devs over its control socket
// (under cfg's run directory) and returns the node's allocation now. A
// device whose enforcer does not answer is not running, with nothing
// allocated.
func Collect(ctx context.Context, cfg *config.Config, devs []device.Info) Node {
	srcs := make([]Source, len(devs))
	for i, d := range devs {
		srcs[i] = api.NewClient(api.ControlSocket(cfg.DeviceRunDir(d.Index)))
	}
	return NewNode(Read(ctx, devs, srcs), time.Now())
}
