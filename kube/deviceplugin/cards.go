package deviceplugin

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/kube/placement"
)

// CardSource tells the state of the node's GPUs.
type CardSource interface {
	// Cards returns the cards of the GPUs that answer. A GPU missing from
	// the list is unhealthy; err, when not nil, says why GPUs are missing
	// (the cards returned with it are still valid).
	Cards(ctx context.Context) ([]placement.Card, error)
}

// enforcerTimeout bounds one question to one enforcer.
const enforcerTimeout = 2 * time.Second

// EnforcerCards asks each GPU's enforcer over its control socket, as
// mgpu-cli device info does.
type EnforcerCards struct {
	gpus    []int
	clients []*api.Client // of gpus[i], kept so that polls reuse connections
}

// NewEnforcerCards returns the source of GPUs gpus of the node cfg
// configures.
func NewEnforcerCards(cfg *config.Config, gpus []int) *EnforcerCards {
	e := &EnforcerCards{gpus: slices.Clone(gpus)}
	for _, g := range e.gpus {
		e.clients = append(e.clients, api.NewClient(api.ControlSocket(cfg.DeviceRunDir(g))))
	}
	return e
}

// Cards implements CardSource: one card per enforcer that answers.
func (e *EnforcerCards) Cards(ctx context.Context) ([]placement.Card, error) {
	var (
		cards []placement.Card
		errs  []error
	)
	for i, g := range e.gpus {
		c, err := e.card(ctx, g, e.clients[i])
		if err != nil {
			errs = append(errs, fmt.Errorf("GPU %d: %w", g, err))
			continue
		}
		cards = append(cards, c)
	}
	return cards, errors.Join(errs...)
}

func (e *EnforcerCards) card(ctx context.Context, gpu int, c *api.Client) (placement.Card, error) {
	ctx, cancel := context.WithTimeout(ctx, enforcerTimeout)
	defer cancel()
	r, err := c.Device(ctx)
	if err != nil {
		return placement.Card{}, err
	}
	return placement.Card{
		Index:         gpu,
		UUID:          r.UUID,
		MemoryMiB:     r.MemoryMiB,
		MemoryFreeMiB: r.MemoryFreeMiB,
		CoreFree:      r.CoreFree,
		Instances:     r.Instances,
	}, nil
}
