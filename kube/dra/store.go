package dra

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
)

// Share is one GPU's part of a prepared claim: what the scheduler
// allocated of one device (its consumedCapacity under one shareID).
type Share struct {
	// Request is the claim's request (or subrequest, "req/sub") the share
	// is allocated for.
	Request string `json:"request"`
	// Device is the ResourceSlice device, gpu-<index>.
	Device string `json:"device"`
	// GPU is the device's GPU index.
	GPU int `json:"gpu"`
	// ShareID is the scheduler's shareID of the allocation.
	ShareID string `json:"share_id,omitempty"`
	// Core is the compute quota, 1..100 (percent of the GPU).
	Core int `json:"core"`
	// MemoryMiB is the memory quota.
	MemoryMiB uint64 `json:"memory_mib"`
}

// Claim is a ResourceClaim this node prepared: who it is for and what it
// holds of each GPU.
type Claim struct {
	UID       string `json:"uid"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// Pods are the UIDs of the pods the claim was reserved for
	// (status.reservedFor) when the kubelet last prepared it.
	Pods   []string `json:"pods"`
	Shares []Share  `json:"shares"`
}

// ReservedFor reports whether the claim is reserved for the pod of UID uid.
func (c Claim) ReservedFor(uid string) bool { return slices.Contains(c.Pods, uid) }

// checkpointVersion is the format of the checkpoint file.
const checkpointVersion = 1

// checkpoint is the file's content.
type checkpoint struct {
	Version int     `json:"version"`
	Driver  string  `json:"driver"`
	Claims  []Claim `json:"claims"`
}

// CheckpointName is the checkpoint's file in the driver's data directory.
const CheckpointName = "checkpoint.json"

// loadCheckpoint reads the prepared claims of path; a missing file is
// none. A file that does not parse, or is another driver's or version's,
// is an error: the claims it holds would otherwise be given out again.
func loadCheckpoint(path, driver string) (map[string]Claim, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return map[string]Claim{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("the DRA checkpoint: %w", err)
	}
	var cp checkpoint
	if err := json.Unmarshal(b, &cp); err != nil {
		return nil, fmt.Errorf("the DRA checkpoint %s does not parse (%w); it holds the node's prepared claims: repair it, or drain the node's DRA pods and remove it", path, err)
	}
	if cp.Version != checkpointVersion || cp.Driver != driver {
		return nil, fmt.Errorf("the DRA checkpoint %s is version %d of driver %q, not version %d of %q", path, cp.Version, cp.Driver, checkpointVersion, driver)
	}
	out := make(map[string]Claim, len(cp.Claims))
	for _, c := range cp.Claims {
		if c.UID == "" {
			return nil, fmt.Errorf("the DRA checkpoint %s holds a claim without a UID", path)
		}
		out[c.UID] = c
	}
	return out, nil
}

// saveCheckpoint writes claims to path atomically: a temporary file in the
// same directory, synced, renamed over it, and the directory synced, so
// that a crash leaves the old file or the new one.
func saveCheckpoint(path, driver string, claims map[string]Claim) error {
	cp := checkpoint{Version: checkpointVersion, Driver: driver, Claims: make([]Claim, 0, len(claims))}
	for _, uid := range sortedKeys(claims) {
		cp.Claims = append(cp.Claims, claims[uid])
	}
	b, err := json.MarshalIndent(cp, "", "  ")
	if err != nil {
		return err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("the DRA checkpoint: %w", err)
	}
	f, err := os.CreateTemp(dir, "."+CheckpointName+".*")
	if err != nil {
		return fmt.Errorf("the DRA checkpoint: %w", err)
	}
	tmp := f.Name()
	defer func() { _ = os.Remove(tmp) }() // after the rename: nothing there
	_, werr := f.Write(append(b, '\n'))
	serr := f.Sync()
	cerr := f.Close()
	if err := errors.Join(werr, serr, cerr); err != nil {
		return fmt.Errorf("the DRA checkpoint: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("the DRA checkpoint: %w", err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("the DRA checkpoint: %w", err)
	}
	defer func() { _ = d.Close() }()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("the DRA checkpoint: %w", err)
	}
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
