package deviceplugin

import (
	"context"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// poll asks the card source once and records each GPU's health; a change
// wakes every ListAndWatch.
func (p *Plugin) poll(ctx context.Context) {
	pctx, cancel := context.WithTimeout(ctx, cardsTimeout)
	cards, err := p.src.Cards(pctx)
	cancel()
	if ctx.Err() != nil {
		return // stopping: what the source said is not news
	}
	answered := map[int]bool{}
	for _, c := range cards {
		answered[c.Index] = true
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	changed := false
	for _, g := range p.gpus {
		was, known := p.healthy[g]
		now := answered[g]
		p.healthy[g] = now
		if shown := !known || was; shown != now {
			changed = true
		}
		switch {
		case now && known && !was:
			p.log.Info("GPU healthy: its enforcer answers", "gpu", g)
		case !now && (was || !known):
			p.log.Warn("GPU unhealthy: its enforcer does not answer", "gpu", g, "err", err)
		}
	}
	if changed {
		close(p.changed)
		p.changed = make(chan struct{})
	}
}

// pollLoop polls every interval while the plugin is active, and at once
// when it becomes active, until ctx ends. The node agent runs one plugin
// per scheme and only the node's mode's is active: the others do not ask
// the enforcers (nor log their health) again and again.
func (p *Plugin) pollLoop(ctx context.Context) {
	t := time.NewTicker(p.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			p.pollIfActive(ctx)
		case <-p.repoll:
			p.poll(ctx)
		}
	}
}

// pollIfActive polls unless the plugin is inactive.
func (p *Plugin) pollIfActive(ctx context.Context) {
	if p.Active() {
		p.poll(ctx)
	}
}

// devices returns the device list as it stands and a channel closed when
// it next changes.
func (p *Plugin) devices() ([]*pluginapi.Device, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]*pluginapi.Device, 0, len(p.gpus)*IDsPerGPU)
	if !p.active {
		return out, p.changed
	}
	for _, g := range p.gpus {
		health := pluginapi.Healthy
		if h, known := p.healthy[g]; known && !h {
			health = pluginapi.Unhealthy
		}
		if p.memGiB != nil {
			for _, id := range memIDs(g, p.memGiB[g]) {
				out = append(out, &pluginapi.Device{ID: id.String(), Health: health})
			}
			continue
		}
		for _, id := range p.scheme.kubeletIDs(g) {
			out = append(out, &pluginapi.Device{ID: id.String(), Health: health})
		}
	}
	return out, p.changed
}

// ListAndWatch implements DevicePluginServer: the device list at once, and
// again whenever a GPU's health changes, until the kubelet goes away or
// the server stops.
func (p *Plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	for {
		devs, changed := p.devices()
		if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: devs}); err != nil {
			return err
		}
		select {
		case <-stream.Context().Done():
			return nil
		case <-changed:
		}
	}
}
